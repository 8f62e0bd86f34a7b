//! NVLink islands from pairwise links: what the scheduler needs to keep a job's GPUs on one
//! NVLink domain.
//!
//! NVML says, for each pair of GPUs, whether they reach each other over NVLink
//! (`nvmlDeviceGetP2PStatus` with the NVLink index). An island is a group of GPUs that are all
//! pairwise linked. On NVSwitch systems every pair is, so the node is one island; on a hybrid
//! cube mesh (DGX-1: two fully linked quads with some links between them) the greedy partition
//! below finds the quads; on bridged pairs it finds the pairs; GPUs without NVLink end up
//! alone.

/// Splits GPUs `0..n` into islands: the lowest GPU not yet placed starts an island, and every
/// later GPU linked to all of the island's members joins it. `linked(a, b)` says whether GPUs
/// `a` and `b` are NVLink peers.
pub fn islands(n: u32, linked: impl Fn(u32, u32) -> bool) -> Vec<Vec<u32>> {
    let mut placed = vec![false; n as usize];
    let mut out = Vec::new();
    for first in 0..n {
        if placed[first as usize] {
            continue;
        }
        let mut island = vec![first];
        placed[first as usize] = true;
        for g in first + 1..n {
            if !placed[g as usize] && island.iter().all(|&m| linked(m, g)) {
                island.push(g);
                placed[g as usize] = true;
            }
        }
        out.push(island);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nvswitch_is_one_island() {
        assert_eq!(islands(8, |_, _| true), vec![(0..8).collect::<Vec<u32>>()]);
    }

    #[test]
    fn a_hybrid_cube_mesh_splits_into_its_two_quads() {
        // DGX-1: each quad fully linked, plus links i <-> i + 4 between the quads.
        let linked = |a: u32, b: u32| a / 4 == b / 4 || a.abs_diff(b) == 4;
        assert_eq!(islands(8, linked), vec![vec![0, 1, 2, 3], vec![4, 5, 6, 7]]);
    }

    #[test]
    fn bridged_pairs_and_unlinked_gpus() {
        assert_eq!(
            islands(4, |a, b| a / 2 == b / 2),
            vec![vec![0, 1], vec![2, 3]]
        );
        assert_eq!(islands(3, |_, _| false), vec![vec![0], vec![1], vec![2]]);
        assert!(islands(0, |_, _| true).is_empty());
    }
}
