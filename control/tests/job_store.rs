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
use perch_control::provenance::{
    GitProvenance, ProvenanceChange, ProvenanceRecord, RunProvenance, SubmitProvenance,
};
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
        mig_instances: Vec::new(),
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
    let submitted = provenance_keeps_the_contract(store);
    store.reopen().expect("reopen");
    assert_eq!(jobs_of(store).len(), 2, "kept across a reopen");
    assert_eq!(
        store.get(&[7]).expect("get")[0].output_deleted_ms,
        Some(5_000)
    );
    assert_eq!(
        store.provenance(7).expect("provenance"),
        Some(submitted),
        "provenance kept across a reopen"
    );
}

/// Provenance records: written whole at submit, each node report added once (a report sent
/// again is not added twice, one for a job with no record makes one), read back by id and in
/// id order over a range. Returns job 7's record as stored.
fn provenance_keeps_the_contract(store: &dyn JobStore) -> ProvenanceRecord {
    assert_eq!(store.provenance(7).expect("read"), None, "none written yet");
    let record = ProvenanceRecord {
        job: 7,
        user: "alice".into(),
        submit_ms: 1_000,
        submit: Some(SubmitProvenance {
            submit_dir: Some("/home/alice/model".into()),
            git: Some(GitProvenance {
                root: "/home/alice/model".into(),
                commit: "0123456789abcdef0123456789abcdef01234567".into(),
                branch: Some("main".into()),
                dirty: true,
                diff: "--- a/x\n+++ b/x\n".into(),
                diff_bytes: 16,
                ..GitProvenance::default()
            }),
            ..SubmitProvenance::default()
        }),
        runs: Vec::new(),
        runs_dropped: 0,
    };
    let run = |node: &str| RunProvenance {
        attempt: 1,
        node: node.into(),
        start_ms: 2_000,
        env: [("CUDA_VISIBLE_DEVICES".to_owned(), "0".to_owned())].into(),
        env_truncated: false,
        driver_version: Some("560.35.03".into()),
        cuda_version: Some("12.6".into()),
        simulated: false,
    };
    let ran = |job: u64, node: &str| ProvenanceChange::Ran {
        job,
        user: "alice".into(),
        submit_ms: 1_000,
        run: run(node),
    };
    store
        .save(&Dirty {
            provenance: vec![
                ProvenanceChange::Submitted(Box::new(record.clone())),
                ran(7, "gpu-1"),
                ran(7, "gpu-1"),
            ],
            ..Dirty::default()
        })
        .expect("save provenance");
    store
        .save(&Dirty {
            provenance: vec![ran(7, "gpu-2"), ran(3, "gpu-1")],
            ..Dirty::default()
        })
        .expect("save more provenance");
    let mut want = record;
    want.runs = vec![run("gpu-1"), run("gpu-2")];
    let got = store.provenance(7).expect("read").expect("written");
    assert_eq!(got, want, "the submit side and each report once, in order");
    let made = store
        .provenance(3)
        .expect("read")
        .expect("made by its report");
    assert_eq!((made.submit, made.runs.len()), (None, 1));
    let mut seen = Vec::new();
    store
        .for_each_provenance(0..=u64::MAX, &mut |r| {
            seen.push(r.job);
            true
        })
        .expect("visit");
    assert_eq!(seen, vec![3, 7], "in id order");
    seen.clear();
    store
        .for_each_provenance(4..=10, &mut |r| {
            seen.push(r.job);
            true
        })
        .expect("visit a range");
    assert_eq!(seen, vec![7]);
    got
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
        "`provenance`",
    ] {
        assert!(
            doc.contains(name),
            "docs/format/job-database.md does not name {name}"
        );
    }
}

// --- the PostgreSQL store ------------------------------------------------------------------

use perch_control::ha::{Lease, LeaseConfig};
use perch_control::pg::PgStore;
use perch_control::pg_testing::TempPostgres;
use std::time::{Duration, Instant};

fn lease(pg: &TempPostgres, name: &str, ttl: Duration) -> Lease {
    let config = LeaseConfig::new(name.into(), format!("http://{name}:7300"), ttl);
    Lease::connect(&pg.url().parse().expect("url"), config, Default::default()).expect("lease")
}

/// Takes the lease for `name`, waiting for the current one to run out.
fn lead(lease: &mut Lease) -> i64 {
    lease.acquire(&|| false).expect("acquired").0.epoch
}

#[test]
fn the_postgresql_store_keeps_the_job_store_contract() {
    let fixture = tempfile::tempdir().expect("tempdir");
    let sample = jobs_of(&RedbStore::open(&copy_fixture(fixture.path())).expect("fixture"));
    let pg = TempPostgres::start().expect("PostgreSQL");
    let epoch = lead(&mut lease(&pg, "a", Duration::from_secs(30)));
    let store = PgStore::open(&pg.url().parse().expect("url"), epoch).expect("open");
    keeps_the_contract(&store, &sample);
    // Saved twice in one change set: the later record is what is kept.
    let mut first = sample[0].clone();
    first.id = 20;
    let mut second = first.clone();
    second.request.name = Some("renamed".into());
    store
        .save(&Dirty {
            jobs: vec![first, second],
            ..Dirty::default()
        })
        .expect("save");
    assert_eq!(
        store.get(&[20]).expect("get")[0].request.name.as_deref(),
        Some("renamed")
    );
}

#[test]
fn a_deposed_leaders_late_writes_are_refused_by_the_database() {
    let fixture = tempfile::tempdir().expect("tempdir");
    let sample = jobs_of(&RedbStore::open(&copy_fixture(fixture.path())).expect("fixture"));
    let pg = TempPostgres::start().expect("PostgreSQL");
    let url: postgres::Config = pg.url().parse().expect("url");
    let ttl = Duration::from_secs(1);
    let mut a = lease(&pg, "a", ttl);
    let first = lead(&mut a);
    let old = PgStore::open(&url, first).expect("open");
    let one = Dirty {
        jobs: vec![sample[0].clone()],
        ..Dirty::default()
    };
    old.save(&one).expect("the leader writes");
    // a stops renewing (a pause, a cut link); b takes over once the lease runs out.
    let mut b = lease(&pg, "b", ttl);
    let started = Instant::now();
    let second = lead(&mut b);
    assert!(started.elapsed() <= ttl + Duration::from_secs(2));
    assert_eq!(second, first + 1, "each holder gets the next epoch");
    let err = old.save(&one).expect_err("a write of the old epoch");
    assert!(
        err.to_string().contains("refused by the database")
            && err.to_string().contains(&format!("epoch {first}")),
        "{err}"
    );
    assert!(
        a.renew(first).expect("renew").is_none(),
        "the old holder cannot renew"
    );
    let new = PgStore::open(&url, second).expect("open");
    new.save(&one).expect("the new leader writes");
    // A write carrying a made-up epoch is refused too: the check is the database's.
    let forged = PgStore::open(&url, second + 5).expect("open");
    assert!(forged.save(&one).is_err());
    // Once the new leader's lease runs out unrenewed, even its own writes are refused.
    std::thread::sleep(ttl + Duration::from_millis(200));
    assert!(new.save(&one).is_err(), "an expired lease writes nothing");
}

#[test]
fn a_released_lease_is_taken_at_the_next_try_and_a_holder_that_stops_renewing_is_told() {
    let pg = TempPostgres::start().expect("PostgreSQL");
    let mut a = lease(&pg, "a", Duration::from_secs(30));
    let first = lead(&mut a);
    let mut b = lease(&pg, "b", Duration::from_secs(30));
    assert!(b.try_acquire().expect("try").is_none(), "a holds it");
    match b.status().role() {
        perch_control::ha::Role::Standby {
            leader: Some(holder),
        } => {
            assert_eq!(
                (holder.name.as_str(), holder.epoch),
                ("a", first),
                "the standby knows who leads"
            );
            assert_eq!(holder.address, "http://a:7300");
        }
        other => panic!("{other:?}"),
    }
    a.release(first).expect("release");
    let started = Instant::now();
    assert_eq!(lead(&mut b), first + 1);
    assert!(started.elapsed() < Duration::from_secs(2));
    // The watchdog: a holder whose renewals cannot reach the database loses the lease at its
    // deadline. Here the database is stopped under it.
    let mut pg = pg;
    let (lost_tx, lost_rx) = std::sync::mpsc::channel();
    let mut c = lease(&pg, "c", Duration::from_secs(2));
    b.release(first + 1).expect("release");
    let (holder, taken) = c.acquire(&|| false).expect("c leads");
    pg.stop();
    let (_keep, stop) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        c.hold(
            holder,
            taken,
            stop,
            std::sync::Arc::new(move |why| {
                let _ = lost_tx.send(why);
            }),
        )
    });
    let why = lost_rx
        .recv_timeout(Duration::from_secs(10))
        .expect("the holder is told it lost the lease");
    assert!(why.contains("could not be renewed in time"), "{why}");
    let elapsed = taken.elapsed();
    assert!(
        elapsed < Duration::from_secs(2),
        "told before the lease ran out in the database: {elapsed:?}"
    );
}

#[test]
fn a_postgresql_job_database_of_a_newer_format_is_refused() {
    let pg = TempPostgres::start().expect("PostgreSQL");
    let url: postgres::Config = pg.url().parse().expect("url");
    drop(PgStore::open(&url, 0).expect("creates the schema"));
    let mut client = url.connect(postgres::NoTls).expect("connect");
    client
        .execute(
            "UPDATE perch_meta SET value = $1 WHERE key = 'format_version'",
            &[&(perch_control::pg::FORMAT_VERSION + 1)],
        )
        .expect("a newer perch's version");
    let err = PgStore::open(&url, 0).expect_err("refused");
    let err = err.to_string();
    assert!(
        err.contains(&format!(
            "format version {}",
            perch_control::pg::FORMAT_VERSION + 1
        )) && err.contains("docs/format/job-database.md"),
        "{err}"
    );
}

#[test]
fn the_control_plane_runs_on_the_postgresql_store() {
    let pg = TempPostgres::start().expect("PostgreSQL");
    let url: postgres::Config = pg.url().parse().expect("url");
    let epoch = lead(&mut lease(&pg, "a", Duration::from_secs(30)));
    let dir = tempfile::tempdir().expect("tempdir");
    let open = || {
        let (tx, _events) = perch_control::JobService::event_channel();
        let store = std::sync::Arc::new(PgStore::open(&url, epoch).expect("open"));
        perch_control::JobService::open(
            dir.path(),
            Default::default(),
            tx,
            store,
            std::sync::Arc::new(perch_control::store::NoSettledRecords),
            Vec::new(),
        )
        .expect("the control plane opens on PostgreSQL")
    };
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    let service = open();
    let spec: perch_control::spec::JobRequest = serde_json::from_value(
        serde_json::json!({ "command": ["train"], "user": "alice", "gpus_per_node": 1 }),
    )
    .expect("spec");
    let (first, _, _) = rt.block_on(service.submit(spec, false)).expect("submitted");
    drop(service);
    let again = open();
    let view = again
        .read(|c| c.view(first.id))
        .expect("view")
        .expect("the job");
    assert_eq!(view.state, JobState::Pending);
}

#[test]
fn a_server_on_another_data_directory_than_the_deployments_is_refused() {
    let pg = TempPostgres::start().expect("PostgreSQL");
    let shared = tempfile::tempdir().expect("tempdir");
    let mut a = lease(&pg, "a", Duration::from_secs(30));
    a.check_data_dir(shared.path())
        .expect("the first server marks it");
    a.check_data_dir(shared.path())
        .expect("and finds its mark again");
    let mut b = lease(&pg, "b", Duration::from_secs(30));
    b.check_data_dir(shared.path())
        .expect("a second server on the shared directory");
    let empty = tempfile::tempdir().expect("tempdir");
    let err = b
        .check_data_dir(empty.path())
        .expect_err("an empty local disk is not the shared directory");
    assert!(
        err.to_string()
            .contains("is not this deployment's shared data directory")
            && err.to_string().contains("server.data_dir"),
        "{err}"
    );
}

#[test]
fn servers_of_a_new_deployment_started_together_agree_on_its_data_directory() {
    let pg = TempPostgres::start().expect("PostgreSQL");
    let shared = tempfile::tempdir().expect("tempdir");
    let url = pg.url();
    let servers = 8;
    // Each connects, then all check at once.
    let together = std::sync::Arc::new(std::sync::Barrier::new(servers));
    let starts: Vec<_> = (0..servers)
        .map(|i| {
            let (url, dir, together) = (url.clone(), shared.path().to_owned(), together.clone());
            std::thread::spawn(move || {
                let config = LeaseConfig::new(
                    format!("s{i}"),
                    format!("http://s{i}"),
                    Duration::from_secs(30),
                );
                let mut lease =
                    Lease::connect(&url.parse().expect("url"), config, Default::default())
                        .expect("lease");
                together.wait();
                lease.check_data_dir(&dir).map_err(|e| e.to_string())
            })
        })
        .collect();
    for start in starts {
        start
            .join()
            .expect("thread")
            .expect("every server finds the one mark");
    }
}
