//! The job store seam: the embedded redb store keeps the contract every [`JobStore`] must
//! (`control/src/store.rs`), reads a job database written by the release before format
//! versions were recorded, and refuses one written by a newer format
//! (`docs/format/job-database.md`).
//!
//! `fixtures/jobs-unversioned.redb` was written by the perch release before this one (commit
//! cbcc264's binary): `perch server --data-dir D`, then as an ordinary user
//! `perch submit --gpus 1 --time 1h -J train -- python train.py`,
//! `perch submit --gpus 2 -J eval -- ./eval.sh`, `perch cancel 2`, and the server stopped;
//! the file is `D/control/jobs.redb`.

use perch_control::JobStore;
use perch_control::db::{Dirty, FORMAT_VERSION, NodeRecord, RedbStore};
use perch_control::record::{JobRecord, JobState, NodeSpan, NodeState};
use std::path::Path;

const FIXTURE: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/tests/fixtures/jobs-unversioned.redb"
);

fn copy_fixture(dir: &Path) -> std::path::PathBuf {
    let path = dir.join("jobs.redb");
    std::fs::copy(FIXTURE, &path).expect("copy the fixture");
    path
}

fn jobs_of(store: &dyn JobStore) -> Vec<JobRecord> {
    let mut jobs = Vec::new();
    store.for_each_job(&mut |job| jobs.push(job)).expect("jobs");
    jobs
}

#[test]
fn a_job_database_of_the_previous_release_opens_whole_and_is_stamped() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = copy_fixture(dir.path());
    let store = RedbStore::open(&path).expect("the previous release's database opens");
    assert_eq!(store.format_version().expect("version"), FORMAT_VERSION);
    let jobs = jobs_of(&store);
    let seen: Vec<(u64, Option<&str>, Option<&str>, JobState)> = jobs
        .iter()
        .map(|j| {
            (
                j.id,
                j.request.name.as_deref(),
                j.request.user.as_deref(),
                j.state,
            )
        })
        .collect();
    assert_eq!(
        seen,
        vec![
            (1, Some("train"), Some("fxuser"), JobState::Pending),
            (2, Some("eval"), Some("fxuser"), JobState::Cancelled),
        ]
    );
    assert_eq!(jobs[0].request.command, vec!["python", "train.py"]);
    // And the control plane rebuilds from it, as a server upgraded in place does.
    drop(store);
    let (tx, _events) = perch_control::JobService::event_channel();
    let service = perch_control::JobService::open_embedded(dir.path(), Default::default(), tx)
        .expect("the control plane opens the previous release's database");
    let pending = service.read(|c| c.view(1)).expect("view").expect("job 1");
    assert_eq!(pending.state, JobState::Pending);
}

#[test]
fn a_job_database_of_a_newer_format_is_refused_naming_both_versions() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("jobs.redb");
    drop(RedbStore::open(&path).expect("create"));
    {
        // What a newer perch would leave: the same file, a later version.
        let db = redb::Database::open(&path).expect("redb");
        let tx = db.begin_write().expect("write");
        {
            let mut meta = tx
                .open_table(redb::TableDefinition::<&str, u32>::new("meta"))
                .expect("meta");
            meta.insert("format_version", FORMAT_VERSION + 1)
                .expect("insert");
        }
        tx.commit().expect("commit");
    }
    let refused = match RedbStore::open(&path) {
        Ok(_) => panic!("a newer format must be refused"),
        Err(e) => e.to_string(),
    };
    for says in [
        format!("format version {}", FORMAT_VERSION + 1),
        format!("reads versions up to {FORMAT_VERSION}"),
        path.display().to_string(),
        "run the perch release that wrote it".to_owned(),
    ] {
        assert!(refused.contains(&says), "{refused} does not say {says}");
    }
}

/// The contract of `control/src/store.rs`, on any store: what one save commits is read back
/// as saved, jobs in id order, nodes and spans whole, output deletions applied to the stored
/// record, and all of it kept across a reopen.
fn keeps_the_contract(store: &dyn JobStore, sample: &[JobRecord]) {
    assert!(jobs_of(store).is_empty(), "a new store holds no job");
    let mut later = sample[1].clone();
    later.id = 7;
    let node = NodeRecord {
        name: "gpu-1".into(),
        gpus: 8,
        model: "H100".into(),
        rack: "r1".into(),
        drained: false,
        nvlink_islands: vec![vec![0, 1, 2, 3], vec![4, 5, 6, 7]],
        gpu_sharing: false,
        drained_by: None,
        drain_reason: None,
        simulated: false,
    };
    let span = NodeSpan {
        node: "gpu-1".into(),
        gpus: 8,
        state: NodeState::Up,
        start_ms: 1_000,
        end_ms: None,
    };
    store
        .save(&Dirty {
            // Out of order: the store keeps them by id.
            jobs: vec![later.clone(), sample[0].clone()],
            nodes: vec![(0, node.clone())],
            node_spans: vec![(0, span.clone())],
            ..Dirty::default()
        })
        .expect("save");
    let ids: Vec<u64> = jobs_of(store).iter().map(|j| j.id).collect();
    assert_eq!(ids, vec![sample[0].id, 7]);
    let got = store.get(&[7, sample[0].id]).expect("get");
    assert_eq!(
        serde_json::to_value(&got).expect("json"),
        serde_json::to_value([&later, &sample[0]]).expect("json"),
        "records read back as saved, in the order asked"
    );
    assert!(store.get(&[99]).is_err(), "a job never saved is an error");
    let loaded = store.load().expect("load");
    assert_eq!(loaded.nodes, vec![node]);
    assert_eq!(loaded.node_spans, vec![(0, span)]);
    store
        .save(&Dirty {
            output_deleted: vec![(7, 5_000)],
            ..Dirty::default()
        })
        .expect("save a deletion");
    assert_eq!(
        store.get(&[7]).expect("get")[0].output_deleted_ms,
        Some(5_000)
    );
    store.reopen().expect("reopen");
    assert_eq!(jobs_of(store).len(), 2, "kept across a reopen");
    assert_eq!(
        store.get(&[7]).expect("get")[0].output_deleted_ms,
        Some(5_000)
    );
}

#[test]
fn the_embedded_store_keeps_the_job_store_contract() {
    let fixture = tempfile::tempdir().expect("tempdir");
    let sample = jobs_of(&RedbStore::open(&copy_fixture(fixture.path())).expect("fixture"));
    let dir = tempfile::tempdir().expect("tempdir");
    let store = RedbStore::open(&dir.path().join("jobs.redb")).expect("open");
    keeps_the_contract(&store, &sample);
}

/// The format document names the version this binary writes: the two cannot drift apart.
#[test]
fn the_format_document_names_the_version_written() {
    let doc = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../docs/format/job-database.md"
    ))
    .expect("docs/format/job-database.md");
    let says = format!("Current version: **{FORMAT_VERSION}**");
    assert!(
        doc.contains(&says),
        "docs/format/job-database.md must say {says}"
    );
    for name in [
        "`meta`",
        "`format_version`",
        "`jobs`",
        "`nodes`",
        "`node_spans`",
    ] {
        assert!(
            doc.contains(name),
            "docs/format/job-database.md does not name {name}"
        );
    }
}
