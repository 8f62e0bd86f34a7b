//! Fractional GPU sharing: where a job asking for part of a GPU may go.
//!
//! A shared job goes onto one GPU of a node that allows sharing ([`crate::NodeSpec::sharing`])
//! when, on that GPU:
//!
//! - no job holds it whole (and it is healthy, on an Up node of the requested model);
//! - the percents granted to its sharers plus the request stay within 100 (the books);
//! - its measured utilization plus the request stays within 100 (what it really does: a GPU
//!   whose sharers use more than they asked for takes no more);
//! - its free memory covers the request, free meaning the measured total minus the larger of
//!   the measured use and the memory granted to its sharers (a job just started has not
//!   allocated yet, a job may use more than it declared). A GPU whose memory was never
//!   measured takes no shares: absent is not zero.
//!
//! Among the GPUs that qualify, GPUs already shared come first, the fullest first (packing, so
//! whole GPUs stay free for whole-GPU jobs); then a free GPU on the node with the fewest free
//! GPUs, in the smallest NVLink island with a free GPU.

use crate::cluster::{Cluster, Node, NodeAlloc, NodeState};
use crate::ids::NodeId;
use crate::job::GpuShare;

/// Whether GPU `i` of `n` has room for `share` (the node is Up and allows sharing, the GPU is
/// healthy and not held whole: checked by the caller).
fn room(n: &Node, i: usize, share: GpuShare) -> bool {
    if n.share_percent(i) + share.percent > 100 {
        return false;
    }
    if n.util[i] + share.percent as f32 > 100.0 {
        return false;
    }
    let Some(total) = n.mem_total[i] else {
        return false;
    };
    let committed = n.mem_used[i].unwrap_or(0).max(n.share_memory(i));
    total.saturating_sub(committed) >= share.memory_mb
}

/// Where a shared job fits: the GPU as a one-bit placement, and whether it takes a GPU that
/// was free (so one fewer whole GPU is left). `cap(node)` is how many free GPUs may still be
/// taken on a node (backfill's reservation); a GPU already shared takes none.
pub(crate) fn find_share(
    cluster: &Cluster,
    share: GpuShare,
    model: Option<usize>,
    cap: impl Fn(usize) -> u32,
) -> Option<(NodeAlloc, bool)> {
    if cluster.sharing_nodes == 0 {
        return None;
    }
    // Best already-shared GPU: (granted percent reversed, node free GPUs, node, gpu), least.
    type SharedKey = (std::cmp::Reverse<u32>, u32, usize, usize);
    let mut best_shared: Option<SharedKey> = None;
    // Best fresh GPU: (node free GPUs, node, one-bit mask), least.
    let mut best_fresh: Option<(u32, usize, u64)> = None;
    for (ni, n) in cluster.nodes.iter().enumerate() {
        if !n.spec.sharing || n.state != NodeState::Up || model.is_some_and(|m| m != n.model) {
            continue;
        }
        let mut shared = n.shared & !n.unhealthy;
        while shared != 0 {
            let i = shared.trailing_zeros() as usize;
            shared &= shared - 1;
            let key = (std::cmp::Reverse(n.share_percent(i)), n.free(), ni, i);
            if room(n, i, share) && best_shared.is_none_or(|b| key < b) {
                best_shared = Some(key);
            }
        }
        if best_shared.is_some() || cap(ni) == 0 {
            continue;
        }
        let mut fits = 0u64;
        let mut free = n.free_mask();
        while free != 0 {
            let i = free.trailing_zeros() as usize;
            free &= free - 1;
            if room(n, i, share) {
                fits |= 1 << i;
            }
        }
        let Some(mask) = smallest_island_pick(n, fits) else {
            continue;
        };
        let key = (n.free(), ni, mask);
        if best_fresh.is_none_or(|b| (key.0, key.1) < (b.0, b.1)) {
            best_fresh = Some(key);
        }
    }
    if let Some((_, _, ni, i)) = best_shared {
        let alloc = NodeAlloc {
            node: NodeId(ni as u32),
            mask: 1 << i,
        };
        return Some((alloc, false));
    }
    best_fresh.map(|(_, ni, mask)| {
        (
            NodeAlloc {
                node: NodeId(ni as u32),
                mask,
            },
            true,
        )
    })
}

/// The lowest GPU of `fits` in the island of `n` with the fewest free GPUs that has one.
fn smallest_island_pick(n: &Node, fits: u64) -> Option<u64> {
    let free = n.free_mask();
    n.islands
        .iter()
        .filter(|&&m| m & fits != 0)
        .min_by_key(|&&m| ((m & free).count_ones(), m.trailing_zeros()))
        .map(|&m| {
            let f = m & fits;
            f & f.wrapping_neg()
        })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::NodeSpec;

    fn share(percent: u32, memory_mb: u64) -> GpuShare {
        GpuShare { percent, memory_mb }
    }

    fn cluster(sharing: bool) -> crate::Result<Cluster> {
        let mut c = Cluster::new();
        let mut spec = NodeSpec::new("n1", 4, "H100", "r1");
        spec.sharing = sharing;
        c.add_node(spec)?;
        for i in 0..4 {
            c.nodes[0].mem_total[i] = Some(80_000);
            c.nodes[0].mem_used[i] = Some(500);
        }
        Ok(c)
    }

    #[test]
    fn shares_pack_onto_the_fullest_shared_gpu_and_never_past_100() -> crate::Result<()> {
        let mut c = cluster(true)?;
        let first = find_share(&c, share(50, 1000), None, |_| u32::MAX);
        assert_eq!(first.map(|(a, fresh)| (a.mask, fresh)), Some((0b1, true)));
        let (first, _) = first.expect("room on GPU 0");
        c.allocate(crate::JobId(1), &[first], Some(share(50, 1000)));
        // 40% more fits on GPU 0, with it.
        let second = find_share(&c, share(40, 1000), None, |_| u32::MAX);
        assert_eq!(second.map(|(a, fresh)| (a.mask, fresh)), Some((0b1, false)));
        // 60% does not: a fresh GPU.
        let third = find_share(&c, share(60, 1000), None, |_| u32::MAX);
        assert_eq!(third.map(|(a, fresh)| (a.mask, fresh)), Some((0b10, true)));
        // With no fresh GPU allowed by the reservation, only GPU 0 can be used.
        assert!(find_share(&c, share(60, 1000), None, |_| 0).is_none());
        Ok(())
    }

    #[test]
    fn measured_load_and_memory_must_leave_room() -> crate::Result<()> {
        let mut c = cluster(true)?;
        // GPU 0 is measured 70% busy, GPU 1 has 79.5 GB used, GPU 2 never reported memory.
        c.nodes[0].util[0] = 70.0;
        c.nodes[0].mem_used[1] = Some(79_500);
        c.nodes[0].mem_total[2] = None;
        c.nodes[0].alloc = 0b1000; // GPU 3 held whole
        let got = find_share(&c, share(40, 1000), None, |_| u32::MAX);
        assert_eq!(
            got, None,
            "70% + 40% > 100%, 500 MB free < 1 GB, unknown, whole"
        );
        assert!(find_share(&c, share(30, 400), None, |_| u32::MAX).is_some());
        Ok(())
    }

    #[test]
    fn nodes_that_do_not_share_take_no_shares() -> crate::Result<()> {
        let c = cluster(false)?;
        assert_eq!(find_share(&c, share(10, 10), None, |_| u32::MAX), None);
        Ok(())
    }
}
