//! A topology file shared by all nodes (`agent.topology_file`): which rack or leaf switch each
//! node hangs off, so one file kept by the operator labels the whole cluster instead of a
//! setting on every node.
//!
//! Two line forms, mixed freely; `#` starts a comment:
//!
//! - `gpu-a rack-1`: a node and its rack;
//! - Slurm's `topology.conf`: `SwitchName=leaf1 Nodes=gpu[01-16],gpu20`; a leaf switch and its
//!   nodes as a host list. Lines with `Switches=` (upper levels) are skipped: perch packs by
//!   leaf.

/// The rack of `node` in topology `text`: `Ok(None)` when the file does not name it; an error
/// says which line is wrong and how.
pub fn rack_of(text: &str, node: &str) -> Result<Option<String>, String> {
    let mut found = None;
    for (n, raw) in text.lines().enumerate() {
        let line = raw.split('#').next().unwrap_or("").trim();
        if line.is_empty() {
            continue;
        }
        let at = |why: String| format!("line {}: {why} (in {line:?})", n + 1);
        if line.contains('=') {
            let mut switch = None;
            let mut nodes = None;
            let mut upper = false;
            for field in line.split_whitespace() {
                let (key, value) = field
                    .split_once('=')
                    .ok_or_else(|| at(format!("{field:?} is not Key=Value")))?;
                match key.to_ascii_lowercase().as_str() {
                    "switchname" => switch = Some(value),
                    "nodes" => nodes = Some(value),
                    "switches" => upper = true,
                    // LinkSpeed and the like say nothing about placement.
                    _ => {}
                }
            }
            let switch = switch.ok_or_else(|| at("no SwitchName=".into()))?;
            if upper && nodes.is_none() {
                continue;
            }
            let nodes = nodes.ok_or_else(|| at("no Nodes= (or Switches=)".into()))?;
            if expand(nodes).map_err(at)?.iter().any(|h| h == node) {
                found.get_or_insert_with(|| switch.to_owned());
            }
        } else {
            let mut words = line.split_whitespace();
            let (Some(name), Some(rack), None) = (words.next(), words.next(), words.next()) else {
                return Err(at(
                    "expected `<node> <rack>` or `SwitchName=<rack> Nodes=<hosts>`".into(),
                ));
            };
            if name == node {
                found.get_or_insert_with(|| rack.to_owned());
            }
        }
    }
    Ok(found)
}

/// Expands a host list: `gpu[01-03,7],cpu1` -> gpu01, gpu02, gpu03, gpu7, cpu1 (zero padding
/// kept; one bracket group per name). At most 100,000 names.
pub fn expand(list: &str) -> Result<Vec<String>, String> {
    const MAX: usize = 100_000;
    let mut out = Vec::new();
    for name in split_top(list) {
        let Some(open) = name.find('[') else {
            out.push(name.to_owned());
            continue;
        };
        let close = name[open..]
            .find(']')
            .map(|c| open + c)
            .ok_or_else(|| format!("{name:?} has `[` without `]`"))?;
        let (prefix, suffix) = (&name[..open], &name[close + 1..]);
        if suffix.contains('[') {
            return Err(format!("{name:?}: one bracket group per name"));
        }
        for part in name[open + 1..close].split(',') {
            let (lo, hi) = part.split_once('-').unwrap_or((part, part));
            let bad = || format!("{part:?} in {name:?} is not a number or a range like 01-16");
            let (a, b): (u64, u64) = (
                lo.parse().map_err(|_| bad())?,
                hi.parse().map_err(|_| bad())?,
            );
            if b < a || b - a >= MAX as u64 {
                return Err(bad());
            }
            for i in a..=b {
                out.push(format!("{prefix}{i:0width$}{suffix}", width = lo.len()));
                if out.len() > MAX {
                    return Err(format!("{list:?} names more than {MAX} hosts"));
                }
            }
        }
    }
    Ok(out)
}

/// Splits at commas outside brackets.
fn split_top(list: &str) -> Vec<&str> {
    let mut parts = Vec::new();
    let (mut depth, mut start) = (0i32, 0);
    for (i, c) in list.char_indices() {
        match c {
            '[' => depth += 1,
            ']' => depth -= 1,
            ',' if depth == 0 => {
                parts.push(&list[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    parts.push(&list[start..]);
    parts.into_iter().filter(|p| !p.is_empty()).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_lists_expand_like_slurms() {
        assert_eq!(
            expand("gpu[01-03,7],cpu1").expect("list"),
            ["gpu01", "gpu02", "gpu03", "gpu7", "cpu1"]
        );
        assert_eq!(
            expand("n[8-10]-ib").expect("list"),
            ["n8-ib", "n9-ib", "n10-ib"]
        );
        assert!(expand("gpu[01-03").is_err());
        assert!(expand("gpu[3-1]").is_err());
        assert!(expand("gpu[a-b]").is_err());
        assert!(expand("gpu[0-999999999]").is_err(), "bounded");
    }

    #[test]
    fn a_node_finds_its_rack_in_either_form() {
        let text = "# the cluster\n\
                    gpu-a rack-1\n\
                    SwitchName=leaf2 Nodes=gpu[01-04] LinkSpeed=100\n\
                    SwitchName=spine Switches=leaf[1-2]\n";
        assert_eq!(rack_of(text, "gpu-a"), Ok(Some("rack-1".into())));
        assert_eq!(rack_of(text, "gpu03"), Ok(Some("leaf2".into())));
        assert_eq!(rack_of(text, "gpu05"), Ok(None));
        let err = rack_of("gpu-a rack-1 extra\n", "gpu-a").expect_err("three words");
        assert!(err.starts_with("line 1:"), "{err}");
        let err = rack_of("SwitchName=x\n", "gpu-a").expect_err("no nodes");
        assert!(err.contains("Nodes="), "{err}");
    }
}
