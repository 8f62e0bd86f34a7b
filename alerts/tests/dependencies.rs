//! The dependency rule of ARCHITECTURE.md for this crate: perch-alerts decides, the server
//! acts, so it must never link the store, the SQL engine, the server or the agent.

#[test]
fn depends_on_none_of_the_store_the_server_or_the_agent() {
    let manifest: toml::Table =
        toml::from_str(include_str!("../Cargo.toml")).expect("alerts/Cargo.toml parses");
    let deps = manifest
        .get("dependencies")
        .and_then(toml::Value::as_table)
        .expect("[dependencies]");
    for forbidden in [
        "datafusion",
        "arrow",
        "parquet",
        "perch-query",
        "perch-server",
        "perch-collector",
    ] {
        assert!(
            !deps.contains_key(forbidden),
            "perch-alerts must not depend on {forbidden} (see ARCHITECTURE.md); the server runs SQL and hands over rows"
        );
    }
    // perch-model, its one perch dependency, depends on no other perch crate.
    let model: toml::Table =
        toml::from_str(include_str!("../../model/Cargo.toml")).expect("model/Cargo.toml");
    let model_deps = model
        .get("dependencies")
        .and_then(toml::Value::as_table)
        .expect("[dependencies]");
    assert!(
        model_deps.keys().all(|k| !k.starts_with("perch-")),
        "{model_deps:?}"
    );
}
