//! The replayed cluster's inventory: N identical nodes (`--nodes`, `--gpus-per-node`), or a
//! cluster file for heterogeneous fleets.
//!
//! Cluster file (header line required, comma-separated, `#` lines ignored), one node per line:
//!
//! | column | required | meaning |
//! |---|---|---|
//! | `name` | yes | the node's name, unique |
//! | `gpus` | yes | GPUs on the node, 1 to 64 |
//! | `model` | yes | GPU model, matched against a trace job's `gpu_model` |
//! | `rack` | yes | rack label (gangs prefer one rack) |
//! | `gpu_memory_gb` | no | memory of each GPU, for fractions of a GPU; default 80 |
//! | `sharing` | no | `true` (default) or `false`: may fractions of a GPU go there |
//!
//! Example: `name,gpus,model,rack` / `a100-01,8,A100,r1` / `t4-01,2,T4,r2`.

use super::csv::{Table, flag};
use super::trace::TraceJob;
use crate::error::{Error, Result};
use crate::job::Shape;
use crate::scheduler::Event;
use crate::{Cluster, NodeId, NodeSpec};

/// GPU memory of a node whose file says nothing (an 80 GB A100 or H100).
pub const DEFAULT_GPU_MEMORY_GB: u64 = 80;

/// One node of the replayed cluster.
#[derive(Clone, Debug, PartialEq)]
pub struct SimNode {
    /// Unique name.
    pub name: String,
    /// GPUs.
    pub gpus: u32,
    /// GPU model.
    pub model: String,
    /// Rack label.
    pub rack: String,
    /// Memory of each GPU, MiB.
    pub gpu_memory_mb: u64,
    /// Whether fractions of a GPU may be placed there.
    pub sharing: bool,
}

/// The replayed cluster.
#[derive(Clone, Debug, PartialEq)]
pub struct SimCluster {
    /// Nodes, in file order.
    pub nodes: Vec<SimNode>,
}

const COLUMNS: [&str; 6] = ["name", "gpus", "model", "rack", "gpu_memory_gb", "sharing"];

impl SimCluster {
    /// `nodes` identical nodes of `gpus_per_node` GPUs (model `sim`, 80 GB each, sharing
    /// allowed), `per_rack` to a rack label.
    pub fn uniform(nodes: u32, gpus_per_node: u32, per_rack: u32) -> SimCluster {
        SimCluster {
            nodes: (0..nodes)
                .map(|i| SimNode {
                    name: format!("node{:04}", i + 1),
                    gpus: gpus_per_node,
                    model: "sim".into(),
                    rack: format!("rack{:02}", i / per_rack.max(1) + 1),
                    gpu_memory_mb: DEFAULT_GPU_MEMORY_GB * 1024,
                    sharing: true,
                })
                .collect(),
        }
    }

    /// Reads a cluster file; the second value holds warnings (unknown columns).
    pub fn load(path: &str) -> Result<(SimCluster, Vec<String>)> {
        let text = std::fs::read_to_string(path).map_err(|source| Error::Io {
            path: path.to_string(),
            source,
        })?;
        SimCluster::parse(path, &text)
    }

    /// Parses cluster file text; `name` appears in errors.
    pub fn parse(name: &str, text: &str) -> Result<(SimCluster, Vec<String>)> {
        let table = Table::parse(name, text)?;
        let err = |line: usize, column: &str, message: String| table.error(line, column, message);
        let needs = "a cluster file needs name,gpus,model,rack; ";
        let (nm, gp, md, rk) = (
            table.need("name", needs)?,
            table.need("gpus", needs)?,
            table.need("model", needs)?,
            table.need("rack", needs)?,
        );
        let (mem, sh) = (table.col("gpu_memory_gb"), table.col("sharing"));
        let warnings: Vec<String> = table
            .unknown_columns(&COLUMNS, "a cluster file")
            .into_iter()
            .collect();
        let mut nodes: Vec<SimNode> = Vec::new();
        let mut seen = std::collections::HashSet::new();
        for (line, f) in &table.rows {
            let line = *line;
            let get = |idx: usize, c: &str| {
                f.get(idx)
                    .copied()
                    .filter(|s| !s.is_empty())
                    .ok_or_else(|| err(line, c, "missing field".into()))
            };
            let opt = |idx: Option<usize>| idx.and_then(|c| f.get(c)).filter(|s| !s.is_empty());
            let node_name = get(nm, "name")?;
            if !seen.insert(node_name.to_string()) {
                return Err(err(
                    line,
                    "name",
                    format!("node `{node_name}` is named twice"),
                ));
            }
            let gpus = get(gp, "gpus")?
                .parse::<u32>()
                .ok()
                .filter(|g| (1..=crate::MAX_GPUS_PER_NODE).contains(g))
                .ok_or_else(|| {
                    err(
                        line,
                        "gpus",
                        format!(
                            "`{}` is not a whole number from 1 to {}",
                            f[gp],
                            crate::MAX_GPUS_PER_NODE
                        ),
                    )
                })?;
            let gpu_memory_mb = match opt(mem) {
                None => DEFAULT_GPU_MEMORY_GB * 1024,
                Some(v) => match v.parse::<f64>() {
                    Ok(gb) if gb.is_finite() && gb > 0.0 && gb < 1e6 => (gb * 1024.0) as u64,
                    _ => {
                        return Err(err(
                            line,
                            "gpu_memory_gb",
                            format!("`{v}` is not a positive number of GB"),
                        ));
                    }
                },
            };
            let sharing = match opt(sh) {
                None => true,
                Some(v) => flag(v).map_err(|m| err(line, "sharing", m))?,
            };
            nodes.push(SimNode {
                name: node_name.into(),
                gpus,
                model: get(md, "model")?.into(),
                rack: get(rk, "rack")?.into(),
                gpu_memory_mb,
                sharing,
            });
        }
        if nodes.is_empty() {
            return Err(err(1, "name", "the file lists no node".into()));
        }
        Ok((SimCluster { nodes }, warnings))
    }

    /// GPUs in all.
    pub fn total_gpus(&self) -> u32 {
        self.nodes.iter().map(|n| n.gpus).sum()
    }

    /// `64 x 8 GPUs`, or `12 nodes, 64 GPUs (A100 48, T4 16)` for a mixed fleet.
    pub fn describe(&self) -> String {
        let Some(first) = self.nodes.first() else {
            return "no nodes".into();
        };
        if self
            .nodes
            .iter()
            .all(|n| n.gpus == first.gpus && n.model == first.model)
        {
            return format!("{} x {} GPUs", self.nodes.len(), first.gpus);
        }
        let mut models: Vec<(&str, u32)> = Vec::new();
        for n in &self.nodes {
            match models.iter_mut().find(|(m, _)| *m == n.model) {
                Some(e) => e.1 += n.gpus,
                None => models.push((&n.model, n.gpus)),
            }
        }
        let models: Vec<String> = models.iter().map(|(m, g)| format!("{m} {g}")).collect();
        format!(
            "{} nodes, {} GPUs ({})",
            self.nodes.len(),
            self.total_gpus(),
            models.join(", ")
        )
    }

    /// A short label without spaces or commas: `3x8` for 3 nodes of 8 GPUs, `mixed12n56g` for a
    /// mixed fleet of 12 nodes and 56 GPUs.
    pub fn label(&self) -> String {
        match self.nodes.first() {
            Some(first)
                if self
                    .nodes
                    .iter()
                    .all(|n| n.gpus == first.gpus && n.model == first.model) =>
            {
                format!("{}x{}", self.nodes.len(), first.gpus)
            }
            _ => format!("mixed{}n{}g", self.nodes.len(), self.total_gpus()),
        }
    }

    /// The scheduler's cluster: every node Up, sharing as the file says.
    pub fn build(&self) -> Result<Cluster> {
        let mut c = Cluster::new();
        for n in &self.nodes {
            let mut spec = NodeSpec::new(&n.name, n.gpus, &n.model, &n.rack);
            spec.sharing = n.sharing;
            c.add_node(spec)?;
        }
        Ok(c)
    }

    /// Each GPU's memory as the agents would report it (0 used), which fractions need.
    pub fn memory_events(&self) -> impl Iterator<Item = Event> + '_ {
        self.nodes.iter().enumerate().flat_map(|(ni, n)| {
            (0..n.gpus).map(move |gpu| Event::GpuUtilization {
                node: NodeId(ni as u32),
                gpu,
                percent: 0.0,
                memory_used_mb: Some(0),
                memory_total_mb: Some(n.gpu_memory_mb),
            })
        })
    }

    fn eligible<'a>(&'a self, job: &'a TraceJob) -> impl Iterator<Item = &'a SimNode> + 'a {
        self.nodes
            .iter()
            .filter(move |n| job.gpu_model.as_ref().is_none_or(|m| *m == n.model))
    }

    /// The gang a job asks for here: the fewest nodes of the largest node size it may use.
    pub fn shape(&self, job: &TraceJob) -> Shape {
        let largest = self.eligible(job).map(|n| n.gpus).max().unwrap_or(1);
        Shape::fewest_nodes(job.gpus, largest)
    }

    /// GPU memory a fraction asks for: what it declared, else its percent of the smallest
    /// GPU it may use (so that a fraction that fits the books fits the memory too).
    pub fn share_memory_mb(&self, job: &TraceJob) -> u64 {
        let percent = job.fraction.unwrap_or(100);
        job.gpu_memory_mb.unwrap_or_else(|| {
            let smallest = self
                .eligible(job)
                .filter(|n| n.sharing)
                .map(|n| n.gpu_memory_mb)
                .min()
                .unwrap_or(0);
            smallest * u64::from(percent) / 100
        })
    }

    /// Why the job could never start on this cluster, when it could not.
    pub fn misfit(&self, job: &TraceJob) -> Option<String> {
        if let Some(m) = &job.gpu_model
            && !self.nodes.iter().any(|n| n.model == *m)
        {
            let mut models: Vec<&str> = self.nodes.iter().map(|n| n.model.as_str()).collect();
            models.sort_unstable();
            models.dedup();
            return Some(format!(
                "asks for GPU model `{m}`, which no node has (models: {})",
                models.join(", ")
            ));
        }
        if job.fraction.is_some() {
            if !self.eligible(job).any(|n| n.sharing) {
                return Some(
                    "asks for a fraction of a GPU, and no node it may use takes fractions \
                     (the cluster file says sharing = false)"
                        .to_string(),
                );
            }
            let need = self.share_memory_mb(job);
            return (!self
                .eligible(job)
                .any(|n| n.sharing && n.gpu_memory_mb >= need))
            .then(|| {
                format!(
                    "asks for a fraction of a GPU with {need} MiB, and no node that shares has a GPU that large"
                )
            });
        }
        let shape = self.shape(job);
        let nodes = self
            .eligible(job)
            .filter(|n| n.gpus >= shape.gpus_per_node)
            .count() as u32;
        (nodes < shape.nodes).then(|| {
            let gpus: u32 = self.eligible(job).map(|n| n.gpus).sum();
            format!(
                "asks for {} GPUs ({} x {}), more than the {} GPUs it may use",
                job.gpus, shape.nodes, shape.gpus_per_node, gpus
            )
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const FILE: &str = "name,gpus,model,rack,gpu_memory_gb,sharing,owner\n\
                        a1,8,A100,r1,40,false,x\n\
                        a2,8,A100,r1,,,x\n\
                        t1,2,T4,r2,16,true,y\n";

    #[test]
    fn a_mixed_fleet_reads_with_its_defaults_and_warns_about_unknown_columns() -> Result<()> {
        let (c, warnings) = SimCluster::parse("c.csv", FILE)?;
        assert_eq!(c.total_gpus(), 18);
        assert_eq!(c.describe(), "3 nodes, 18 GPUs (A100 16, T4 2)");
        assert_eq!(
            (c.nodes[0].gpu_memory_mb, c.nodes[0].sharing),
            (40 * 1024, false)
        );
        assert_eq!(
            (c.nodes[1].gpu_memory_mb, c.nodes[1].sharing),
            (80 * 1024, true)
        );
        assert_eq!(warnings.len(), 1);
        assert!(warnings[0].contains("owner"), "{warnings:?}");
        assert_eq!(c.build()?.total_gpus(), 18);
        Ok(())
    }

    #[test]
    fn bad_lines_name_the_line_and_column() {
        let check = |text: &str, line: usize, column: &str| match SimCluster::parse("c.csv", text) {
            Err(Error::Trace {
                line: l, column: c, ..
            }) => assert_eq!((l, c.as_str()), (line, column), "{text}"),
            other => panic!("expected an error for {text:?}, got {other:?}"),
        };
        check("name,gpus,model\n", 1, "rack");
        check("name,gpus,model,rack\na,0,A100,r\n", 2, "gpus");
        check("name,gpus,model,rack\na,65,A100,r\n", 2, "gpus");
        check("name,gpus,model,rack\na,8,A100,r\na,8,A100,r\n", 3, "name");
        check("name,gpus,model,rack\na,8,,r\n", 2, "model");
        check(
            "name,gpus,model,rack,sharing\na,8,A,r,maybe\n",
            2,
            "sharing",
        );
        check("name,gpus,model,rack\n", 1, "name");
    }

    #[test]
    fn jobs_that_cannot_fit_say_why() -> Result<()> {
        let (c, _) = SimCluster::parse("c.csv", FILE)?;
        let mut j = TraceJob::new(0, 1, 16, "a", "a");
        assert_eq!(c.misfit(&j), None, "2 x 8 A100");
        j.gpus = 17;
        assert!(c.misfit(&j).is_some_and(|m| m.contains("17 GPUs")));
        j.gpus = 4;
        j.gpu_model = Some("T4".into());
        assert!(c.misfit(&j).is_some_and(|m| m.contains("4 GPUs")));
        j.gpu_model = Some("H100".into());
        assert!(c.misfit(&j).is_some_and(|m| m.contains("A100, T4")));
        // A fraction: on a T4 (16 GB, shares) or a2 (80 GB, shares), not a1.
        let mut f = TraceJob::new(0, 1, 1, "a", "a");
        f.fraction = Some(50);
        assert_eq!(
            c.share_memory_mb(&f),
            8 * 1024,
            "half the smallest sharing GPU"
        );
        assert_eq!(c.misfit(&f), None);
        f.gpu_memory_mb = Some(100 * 1024);
        assert!(c.misfit(&f).is_some_and(|m| m.contains("102400 MiB")));
        // Pinned to the A100s, where only a1 (which does not share) and a2 are: a2 takes it;
        // with a2 gone no A100 node shares.
        f.gpu_memory_mb = None;
        f.gpu_model = Some("A100".into());
        assert_eq!(c.misfit(&f), None);
        let mut no_share = c.clone();
        no_share.nodes.retain(|n| n.name != "a2");
        assert!(
            no_share
                .misfit(&f)
                .is_some_and(|m| m.contains("sharing = false"))
        );
        Ok(())
    }
}
