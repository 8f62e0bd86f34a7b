//! Topology-aware gang placement: where a `nodes x gpus_per_node` gang fits, if anywhere.
//!
//! Rules, in order: only Up nodes, only healthy unallocated GPUs, only the requested model;
//! a one-node job goes to the node with the fewest free GPUs that still fits it (best fit, so
//! whole nodes stay free for gangs); a multi-node gang goes to one rack label when any rack can
//! hold it (the rack with the fewest candidate nodes that suffices, and in it the fullest nodes),
//! else across the fewest racks. A `cap` per node limits how many GPUs may be taken there
//! (backfill uses it to keep the head job's reservation whole).
//!
//! Within a node, GPUs follow NVLink: the job's GPUs go inside one NVLink island when one has
//! enough free GPUs (the island with the fewest free that suffices, so large islands stay
//! whole), else across the fewest islands; among equal choices the lowest free indices are
//! taken, as on a node without NVLink information (one island). A one-node job also prefers
//! a node where it fits in one island over a fuller node where it would not.

use crate::cluster::{Cluster, NodeAlloc, Placement};
use crate::job::Shape;

/// Lowest `g` set bits of `mask`.
fn take_lowest(mut mask: u64, g: u32) -> u64 {
    let mut out = 0;
    for _ in 0..g {
        let bit = mask & mask.wrapping_neg();
        out |= bit;
        mask &= !bit;
    }
    out
}

/// The fewest islands among `islands` whose free GPUs (`free & island`) add up to `g`, and the
/// GPUs to take: inside one island when any holds `g` (the one with the fewest free GPUs, then
/// the lowest), else the islands with the most free GPUs first, the last one best-fit. `None`
/// when `free` has fewer than `g` GPUs.
pub(crate) fn choose_gpus(free: u64, g: u32, islands: &[u64]) -> Option<(u32, u64)> {
    if free.count_ones() < g {
        return None;
    }
    if islands.len() <= 1 {
        return Some((1, take_lowest(free, g)));
    }
    // (free GPUs in the island, its lowest index, mask), for islands with any free GPU.
    let mut cands: Vec<(u32, u32, u64)> = islands
        .iter()
        .map(|&m| (free & m).count_ones())
        .zip(islands)
        .filter(|(f, _)| *f > 0)
        .map(|(f, &m)| (f, m.trailing_zeros(), m))
        .collect();
    if let Some(&(_, _, m)) = cands
        .iter()
        .filter(|(f, _, _)| *f >= g)
        .min_by_key(|(f, low, _)| (*f, *low))
    {
        return Some((1, take_lowest(free & m, g)));
    }
    // Largest islands first: the fewest islands that add up to g.
    cands.sort_by_key(|&(f, low, _)| (std::cmp::Reverse(f), low));
    let mut need = g;
    let mut out = 0u64;
    let mut used = 0u32;
    let mut i = 0;
    while need > 0 && i < cands.len() {
        let (f, _, m) = cands[i];
        if f >= need {
            // The last island: the smallest one left that covers the rest.
            let (_, _, best) = cands[i..]
                .iter()
                .filter(|(f, _, _)| *f >= need)
                .min_by_key(|(f, low, _)| (*f, *low))
                .copied()
                .unwrap_or((f, 0, m));
            out |= take_lowest(free & best, need);
            need = 0;
        } else {
            out |= free & m;
            need -= f;
        }
        used += 1;
        i += 1;
    }
    Some((used, out))
}

/// Finds a placement for `shape` on nodes of `model` (any when `None`), taking at most
/// `cap(node_index)` GPUs on a node.
pub(crate) fn find(
    cluster: &Cluster,
    shape: Shape,
    model: Option<usize>,
    cap: impl Fn(usize) -> u32,
) -> Option<Placement> {
    let g = shape.gpus_per_node;
    if cluster.nodes_with_free(model, g) < shape.nodes {
        return None;
    }
    let usable = |i: usize| -> Option<u32> {
        let n = &cluster.nodes[i];
        if model.is_some_and(|m| m != n.model) {
            return None;
        }
        let f = n.free().min(cap(i));
        (f >= g).then_some(f)
    };
    let choose = |i: usize| {
        let n = &cluster.nodes[i];
        choose_gpus(n.free_mask(), g, &n.islands)
    };
    let grant = |i: usize| NodeAlloc {
        node: crate::ids::NodeId(i as u32),
        mask: choose(i).map_or(0, |(_, mask)| mask),
    };
    if shape.nodes == 1 {
        // (islands the job would span, free GPUs, node): fewest islands, then best fit.
        let mut best: Option<(u32, u32, usize)> = None;
        for i in 0..cluster.nodes.len() {
            let Some(f) = usable(i) else {
                continue;
            };
            let spans = if cluster.nodes[i].islands.len() <= 1 {
                1
            } else {
                choose(i).map_or(u32::MAX, |(k, _)| k)
            };
            if best.is_none_or(|(bs, bf, _)| (spans, f) < (bs, bf)) {
                best = Some((spans, f, i));
                if spans == 1 && f == g {
                    break;
                }
            }
        }
        return best.map(|(_, _, i)| vec![grant(i)]);
    }
    // Candidate nodes grouped by rack, each as (free, index).
    let mut by_rack: Vec<Vec<(u32, usize)>> = vec![Vec::new(); cluster.racks.len()];
    for i in 0..cluster.nodes.len() {
        if let Some(f) = usable(i) {
            by_rack[cluster.nodes[i].rack].push((f, i));
        }
    }
    let k = shape.nodes as usize;
    let total: usize = by_rack.iter().map(Vec::len).sum();
    if total < k {
        return None;
    }
    let single = by_rack
        .iter()
        .enumerate()
        .filter(|(_, r)| r.len() >= k)
        .min_by_key(|(i, r)| (r.len(), *i));
    let mut chosen: Vec<usize> = Vec::with_capacity(k);
    if let Some((_, rack)) = single {
        let mut rack = rack.clone();
        rack.sort_unstable();
        chosen.extend(rack.iter().take(k).map(|&(_, i)| i));
    } else {
        let mut racks: Vec<&Vec<(u32, usize)>> = by_rack.iter().filter(|r| !r.is_empty()).collect();
        racks.sort_by_key(|r| std::cmp::Reverse(r.len()));
        'outer: for rack in racks {
            let mut rack = rack.clone();
            rack.sort_unstable();
            for &(_, i) in &rack {
                chosen.push(i);
                if chosen.len() == k {
                    break 'outer;
                }
            }
        }
    }
    chosen.sort_unstable();
    Some(chosen.into_iter().map(grant).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn take_lowest_takes_the_lowest_bits() {
        assert_eq!(take_lowest(0b1011_0100, 2), 0b0001_0100);
        assert_eq!(take_lowest(0b1, 1), 0b1);
    }

    #[test]
    fn one_node_job_goes_to_the_fullest_node_that_fits() -> crate::Result<()> {
        let mut c = Cluster::uniform(3, 8, "H100", 8)?;
        c.modify(1, |n| n.alloc = 0b0011_1111); // 2 free
        c.modify(2, |n| n.alloc = 0b0000_1111); // 4 free
        let p = find(
            &c,
            Shape {
                nodes: 1,
                gpus_per_node: 2,
            },
            None,
            |_| u32::MAX,
        );
        assert_eq!(p.map(|p| p[0].node.0), Some(1));
        let p = find(
            &c,
            Shape {
                nodes: 1,
                gpus_per_node: 3,
            },
            None,
            |_| u32::MAX,
        );
        assert_eq!(p.map(|p| p[0].node.0), Some(2));
        Ok(())
    }

    fn islands(groups: &[&[u32]]) -> Vec<u64> {
        groups
            .iter()
            .map(|g| g.iter().fold(0u64, |m, i| m | (1 << i)))
            .collect()
    }

    #[test]
    fn gpus_stay_inside_one_nvlink_island_when_they_can() {
        let two = islands(&[&[0, 1, 2, 3], &[4, 5, 6, 7]]);
        // GPUs 1 and 2 busy: 4 GPUs fit only in the second island.
        let free = 0xff & !0b0110;
        assert_eq!(choose_gpus(free, 4, &two), Some((1, 0b1111_0000)));
        // 2 GPUs: the island with the fewest free GPUs that holds them (0 and 3).
        assert_eq!(choose_gpus(free, 2, &two), Some((1, 0b1001)));
        // 6 GPUs: two islands, the bigger one whole.
        assert_eq!(choose_gpus(free, 6, &two), Some((2, 0b1111_1001)));
        // No island information: today's lowest indices.
        assert_eq!(choose_gpus(free, 4, &[0xff]), Some((1, 0b0011_1001)));
        assert_eq!(choose_gpus(free, 7, &two), None);
    }

    #[test]
    fn fewest_islands_then_best_fit_for_the_rest() {
        // Four pairs with 2, 1, 2 and 1 free GPUs; 3 GPUs: one full pair and the best-fit
        // single, two islands (not three singles).
        let pairs = islands(&[&[0, 1], &[2, 3], &[4, 5], &[6, 7]]);
        let free = 0b0111_0111; // 0,1,2 | 4,5,6
        assert_eq!(choose_gpus(free, 3, &pairs), Some((2, 0b0000_0111)));
        // GPUs 0..8 each alone (NVLink-less): any 3, lowest first, 3 islands.
        let singles: Vec<u64> = (0..8).map(|i| 1u64 << i).collect();
        assert_eq!(choose_gpus(0xff, 3, &singles), Some((3, 0b111)));
    }

    #[test]
    fn a_one_node_job_prefers_a_node_where_it_fits_one_island() -> crate::Result<()> {
        let mut c = Cluster::new();
        for name in ["a", "b"] {
            let mut spec = crate::NodeSpec::new(name, 8, "H100", "r1");
            spec.nvlink_islands = vec![vec![0, 1, 2, 3], vec![4, 5, 6, 7]];
            c.add_node(spec)?;
        }
        // a: 4 free, split 2 + 2; b: 5 free, 4 of them in one island.
        c.modify(0, |n| n.alloc = 0b1100_1100);
        c.modify(1, |n| n.alloc = 0b0000_0111);
        let shape = Shape {
            nodes: 1,
            gpus_per_node: 4,
        };
        let p = find(&c, shape, None, |_| u32::MAX).unwrap_or_default();
        assert_eq!(
            p.first().map(|a| (a.node.0, a.mask)),
            Some((1, 0b1111_0000))
        );
        Ok(())
    }

    #[test]
    fn gang_prefers_one_rack() -> crate::Result<()> {
        // racks of 2 nodes: rack01 = {0,1}, rack02 = {2,3}; node 1 busy.
        let mut c = Cluster::uniform(4, 8, "H100", 2)?;
        c.modify(1, |n| n.alloc = 1);
        let p = find(
            &c,
            Shape {
                nodes: 2,
                gpus_per_node: 8,
            },
            None,
            |_| u32::MAX,
        );
        let nodes: Vec<u32> = p.unwrap_or_default().iter().map(|a| a.node.0).collect();
        assert_eq!(nodes, vec![2, 3]);
        Ok(())
    }
}
