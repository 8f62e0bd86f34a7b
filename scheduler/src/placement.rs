//! Topology-aware gang placement: where a `nodes x gpus_per_node` gang fits, if anywhere.
//!
//! Rules, in order: only Up nodes, only healthy unallocated GPUs, only the requested model;
//! a one-node job goes to the node with the fewest free GPUs that still fits it (best fit, so
//! whole nodes stay free for gangs); a multi-node gang goes to one rack label when any rack can
//! hold it (the rack with the fewest candidate nodes that suffices, and in it the fullest nodes),
//! else across the fewest racks. Within a node the lowest free GPU indices are taken.
//! A `cap` per node limits how many GPUs may be taken there (backfill uses it to keep the
//! head job's reservation whole).

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
    let grant = |i: usize| NodeAlloc {
        node: crate::ids::NodeId(i as u32),
        mask: take_lowest(cluster.nodes[i].free_mask(), g),
    };
    if shape.nodes == 1 {
        let mut best: Option<(u32, usize)> = None;
        for i in 0..cluster.nodes.len() {
            if let Some(f) = usable(i)
                && best.is_none_or(|(bf, _)| f < bf)
            {
                best = Some((f, i));
                if f == g {
                    break;
                }
            }
        }
        return best.map(|(_, i)| vec![grant(i)]);
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
