//! The operator-facing files are run or checked, so they cannot rot:
//!
//! - the Python client's example (docs/INTEGRATION.md, section 1) runs against a
//!   real `serve`'s socket and prints what the doc shows;
//! - `examples/embed.rs` (built by `cargo test` next to the test binary) runs;
//! - every `treewarden run` row of the exit-code table in
//!   `docs/INTEGRATION.md` is run with the real binary and must exit as the
//!   table says; `--die-with-parent` is checked by killing the parent;
//! - `deploy/prometheus/*` pass `promtool check rules`, `check config` and
//!   `test rules`, and every dashboard query parses as PromQL (promtool;
//!   "skipped: <why>" without it);
//! - every `treewarden_*` name in the alert rules and the Grafana dashboard
//!   appears in a live `/metrics` scrape; every alert has a summary, a
//!   description and a runbook link to its own section of RUNBOOK.md;
//! - `deploy/otel-collector.yaml` is well formed (python3 + PyYAML);
//! - every `deploy/…` and `docs/…` path the docs mention exists;
//! - README.md and docs/*.md hold no control character;
//! - every shell example of README.md runs as written, in order, against
//!   the binary `cargo test` built (the service's in the background).
//!
//! Only 127.0.0.1 is contacted; every child is waited for with a bound and
//! ended by pid.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use serde_json::Value;

use crate::custody::{Env, own_cgroup_dir};
use crate::serve::{Server, spawn_and_kill, tool};
use crate::util::{bin, is_root, skip, wait_child, wait_until};

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn read(rel: &str) -> String {
    std::fs::read_to_string(repo().join(rel)).unwrap_or_else(|e| panic!("{rel}: {e}"))
}

/// The boundary tests can form here without colliding with other tests:
/// cgroup (under a per-test root that [`Env`] creates) as root, else session.
fn boundary() -> &'static str {
    if is_root() && own_cgroup_dir().is_some() {
        "cgroup"
    } else {
        "session"
    }
}

fn env() -> Env {
    Env::new(boundary())
        .or_else(|| Env::new("session"))
        .expect("session boundary")
}

/// Runs a command to completion with a bound; its output and status.
fn run_bounded(mut cmd: Command, limit: Duration) -> (Option<i32>, String, String) {
    let dir = tempfile::tempdir().expect("temp dir");
    let (out, err) = (dir.path().join("out"), dir.path().join("err"));
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(std::fs::File::create(&out).expect("stdout file"))
        .stderr(std::fs::File::create(&err).expect("stderr file"))
        .spawn()
        .expect("spawn");
    let status = wait_child(&mut child, limit);
    let read = |p: &Path| std::fs::read_to_string(p).unwrap_or_default();
    (
        status.and_then(|s| {
            s.code()
                .or_else(|| std::os::unix::process::ExitStatusExt::signal(&s).map(|n| 128 + n))
        }),
        read(&out),
        read(&err),
    )
}

/// The first fenced block of `lang` after `heading` in `text`.
fn fenced_after<'a>(text: &'a str, heading: &str, lang: &str) -> &'a str {
    let from = text
        .find(heading)
        .unwrap_or_else(|| panic!("no {heading:?}"));
    let open = format!("```{lang}\n");
    let start = text[from..]
        .find(&open)
        .map(|i| from + i + open.len())
        .unwrap_or_else(|| panic!("no ```{lang} block after {heading:?}"));
    let len = text[start..].find("\n```").expect("block closed");
    &text[start..start + len + 1]
}

#[test]
fn the_python_client_example_runs_against_a_real_server() {
    if tool("python3").is_none() {
        skip("python3 not installed");
        return;
    }
    // The example of INTEGRATION.md's first section, as printed there,
    // against a real serve's socket, with the package from clients/python.
    let doc = read("docs/INTEGRATION.md");
    let heading = "## 1. From Python";
    let script = fenced_after(&doc, heading, "python");
    let expected = fenced_after(&doc, heading, "text");
    let mut s = Server::start(&[]);
    let path = s.dir.path().join("example.py");
    std::fs::write(&path, script).expect("write the example");
    let mut cmd = Command::new("python3");
    cmd.arg(&path)
        .current_dir(s.dir.path())
        .env("PYTHONPATH", repo().join("clients/python"))
        .env("TREEWARDEN_SOCKET", s.data_dir().join("api.sock"))
        .env("TREEWARDEN_DATA_DIR", s.data_dir())
        .env("TREEWARDEN_BIN", bin())
        .env("TW_TEST_MARK", &s.mark);
    let (code, out, err) = run_bounded(cmd, Duration::from_secs(90));
    assert_eq!(
        code,
        Some(0),
        "the example failed:\n{out}\n{err}\nserve: {}",
        s.stderr()
    );
    assert_eq!(
        out, expected,
        "the example's output is not the one printed in the doc"
    );
    // Nothing it started lives on: no tree is left alive in the ledger, and
    // nothing carrying the marker (the wrapper's trees inherit it) runs.
    let alive: Value = s.get("/api/trees?alive=1").json().expect("json");
    assert_eq!(alive.as_array().map(Vec::len), Some(0), "{alive}");
    assert!(
        wait_until(Duration::from_secs(10), || s.marked().is_empty()),
        "left running: {:?}",
        s.marked()
    );
    let status = s.terminate().expect("serve exits");
    assert_eq!(status.code(), Some(0), "{}", s.stderr());
}

/// `target/<profile>/examples/embed`, built by `cargo test` with the tests.
fn embed_bin() -> PathBuf {
    bin()
        .parent()
        .expect("the binary lives in a target dir")
        .join("examples")
        .join("embed")
}

#[test]
fn the_rust_embedding_example_runs() {
    let embed = embed_bin();
    assert!(
        embed.exists(),
        "{} missing: run the whole `cargo test` (it builds the examples)",
        embed.display()
    );
    let env = env();
    // The example spawns with its own environment, so the marker reaches
    // the tree and survivors could be found (and ended) independently.
    let mut cmd = env.cmd_for(&embed);
    cmd.arg(env.data_dir())
        .env("TW_TEST_MARK", &env.mark)
        .env("TREEWARDEN_LOG", "warn");
    let (code, out, err) = run_bounded(cmd, Duration::from_secs(60));
    assert_eq!(code, Some(0), "embed failed:\n{out}\n{err}");
    assert!(out.contains("spawned tree 1"), "{out}");
    let seen: usize = out
        .lines()
        .find_map(|l| l.strip_prefix("members seen: "))
        .and_then(|n| n.trim().parse().ok())
        .unwrap_or(0);
    assert!(seen >= 3, "{out}");
    let report: Value = serde_json::from_str(&out[out.find('{').expect("report json")..])
        .unwrap_or_else(|e| panic!("report is not JSON ({e}):\n{out}"));
    assert_eq!(report["state"], "ended", "{out}");
    assert!(report["members_at_start"].as_u64() >= Some(3), "{out}");
    assert!(env.wait_none_marked(), "survivors: {:?}", env.marked());
    // The ledger it wrote is a real one: verify passes, show agrees.
    let verify = env.output(&["verify"]);
    assert!(
        verify.status.success(),
        "verify: {}",
        String::from_utf8_lossy(&verify.stderr)
    );
    assert_eq!(env.show(1)["tree"]["state"], "ended");
}

/// The `| `treewarden run …` | N | … |` rows of INTEGRATION.md's table.
fn exit_code_rows(doc: &str) -> Vec<(String, i32)> {
    doc.lines()
        .filter_map(|l| {
            let cells: Vec<&str> = l.split('|').map(str::trim).collect();
            let cmd = cells
                .get(1)?
                .strip_prefix("`treewarden ")?
                .strip_suffix('`')?;
            let code = cells.get(2)?.parse().ok()?;
            Some((cmd.to_string(), code))
        })
        .collect()
}

#[test]
fn the_wrapper_exit_codes_in_integration_md_are_what_run_returns() {
    let rows = exit_code_rows(&read("docs/INTEGRATION.md"));
    assert!(rows.len() >= 5, "exit-code table not found: {rows:?}");
    for (args, want) in rows {
        let env = env();
        // Exactly the documented words, after `treewarden`, through sh.
        let mut cmd = env.cmd_for("sh");
        cmd.args(["-c", &format!("exec \"$TW\" {args}")])
            .env("TW", bin())
            .env("TW_TEST_MARK", &env.mark);
        let (code, out, err) = run_bounded(cmd, Duration::from_secs(60));
        assert_eq!(
            code,
            Some(want),
            "`treewarden {args}` exited {code:?}, INTEGRATION.md says {want}\n{out}{err}"
        );
        assert!(
            env.wait_none_marked(),
            "`treewarden {args}` left {:?} running",
            env.marked()
        );
    }
}

#[test]
fn run_with_die_with_parent_tears_the_tree_down_when_its_parent_dies() {
    let env = env();
    // The parent is a shell that starts `treewarden run --die-with-parent`
    // (as INTEGRATION.md's wrapper does) and waits; we SIGKILL the shell.
    let mut cmd = env.cmd_for("sh");
    cmd.args([
        "-c",
        "\"$TW\" run --die-with-parent --timeout 10m -- sh -c 'sleep 300 & sleep 300 & wait' & wait",
    ])
    .env("TW", bin())
    .env("TW_TEST_MARK", &env.mark)
    .stdin(Stdio::null())
    .stdout(Stdio::null())
    .stderr(Stdio::null());
    let mut parent = cmd.spawn().expect("parent shell");
    // parent sh, treewarden run, root sh, two sleeps
    assert!(env.wait_marked(5), "tree did not start: {:?}", env.marked());
    let _ = parent.kill();
    let _ = parent.wait();
    assert!(
        env.wait_none_marked(),
        "tree outlived run's parent: {:?}",
        env.marked()
    );
    let trees: Value =
        serde_json::from_slice(&env.output(&["ls", "--all", "--json"]).stdout).expect("ls json");
    assert_eq!(trees[0]["state"], "ended", "{trees}");
}

/// `- alert: Name` blocks of the rules file: (name, block text).
fn alerts(rules: &str) -> Vec<(String, String)> {
    let mut out: Vec<(String, String)> = Vec::new();
    for line in rules.lines() {
        if let Some(name) = line.trim().strip_prefix("- alert:") {
            out.push((name.trim().to_string(), String::new()));
        } else if let Some((_, block)) = out.last_mut() {
            block.push_str(line);
            block.push('\n');
        }
    }
    out
}

/// Every `treewarden_*` identifier in a text.
fn metric_names(text: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    let mut rest = text;
    while let Some(at) = rest.find("treewarden_") {
        let tail = &rest[at..];
        let end = tail
            .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
            .unwrap_or(tail.len());
        out.insert(tail[..end].to_string());
        rest = &tail[end..];
    }
    out
}

/// Every query of the dashboard: panel targets and variable queries.
fn dashboard_queries(dash: &Value) -> Vec<String> {
    let mut out = Vec::new();
    for p in dash["panels"].as_array().expect("panels") {
        for t in p["targets"].as_array().into_iter().flatten() {
            out.push(t["expr"].as_str().expect("expr").to_string());
        }
    }
    for v in dash["templating"]["list"].as_array().expect("templating") {
        if let Some(q) = v["definition"].as_str() {
            out.push(q.to_string());
        }
    }
    out
}

#[test]
fn the_dashboard_is_valid_json_with_a_datasource_variable_and_a_query_per_panel() {
    let dash: Value = serde_json::from_str(&read("deploy/grafana/treewarden.json"))
        .expect("deploy/grafana/treewarden.json is not JSON");
    let vars = dash["templating"]["list"].as_array().expect("variables");
    assert!(
        vars.iter()
            .any(|v| v["type"] == "datasource" && v["query"] == "prometheus"),
        "no Prometheus datasource variable"
    );
    let mut ids = BTreeSet::new();
    let mut titles = Vec::new();
    for p in dash["panels"].as_array().expect("panels") {
        assert!(
            ids.insert(p["id"].as_i64().expect("id")),
            "duplicate id {p}"
        );
        if p["type"] == "row" {
            continue;
        }
        assert_eq!(p["datasource"]["uid"], "${datasource}", "{}", p["title"]);
        let targets = p["targets"].as_array().expect("targets");
        assert!(!targets.is_empty(), "{} has no query", p["title"]);
        titles.push(p["title"].as_str().expect("title").to_lowercase());
    }
    for want in [
        "trees by state",
        "dispatch",
        "signals by kind",
        "authorizations",
        "kills skipped",
        "escapes",
        "survivors",
        "sweeps",
        "scan duration",
        "teardown duration",
        "ledger head seq",
        "write errors",
    ] {
        assert!(
            titles.iter().any(|t| t.contains(want)),
            "no panel for {want}: {titles:?}"
        );
    }
}

#[test]
fn every_alert_has_a_summary_a_description_and_its_own_runbook_section() {
    let rules = read("deploy/prometheus/treewarden-rules.yml");
    let runbook = read("docs/RUNBOOK.md");
    let all = alerts(&rules);
    let names: Vec<&str> = all.iter().map(|(n, _)| n.as_str()).collect();
    for want in [
        "TreewardenDown",
        "TreewardenDispatchClosed",
        "TreewardenAmbiguousTree",
        "TreewardenEscapesObserved",
        "TreewardenSurvivorsAfterKill",
        "TreewardenKillsSkipped",
        "TreewardenKillAuthorizationsFailed",
        "TreewardenLedgerWriteErrors",
        "TreewardenSweepFoundOrphans",
        "TreewardenScansSlowerThanInterval",
    ] {
        assert!(names.contains(&want), "no alert {want}: {names:?}");
    }
    for (name, block) in &all {
        for key in ["summary:", "description:", "severity:"] {
            assert!(block.contains(key), "{name} has no {key}");
        }
        // Its section as the alerting host's service serves the runbook.
        let anchor = format!("/runbook#{}", name.to_lowercase());
        assert!(
            block.contains("runbook_url: ") && block.contains(&anchor),
            "{name}'s runbook_url does not point at {anchor}"
        );
        assert!(
            runbook.lines().any(|l| l.trim() == format!("## {name}")),
            "RUNBOOK.md has no `## {name}` section"
        );
    }
    // The scrape job the `up` alert names is the one prometheus.yml defines.
    assert!(rules.contains("up{job=\"treewarden\"}"));
    assert!(read("deploy/prometheus/prometheus.yml").contains("job_name: treewarden"));
    // The rule tests cover at least the two alerts the issue names.
    let tests = read("deploy/prometheus/treewarden-rules.test.yml");
    for name in ["TreewardenDispatchClosed", "TreewardenKillsSkipped"] {
        assert!(
            tests.contains(&format!("alertname: {name}")),
            "{name} untested"
        );
    }
}

#[test]
fn alert_rules_and_dashboard_use_only_metrics_a_live_server_exports() {
    let s = Server::start(&[]);
    // Exercise the service so every family has samples: a forced kill
    // (signals, authorization, teardown histogram) and a scan.
    spawn_and_kill(&s);
    let mut text = String::new();
    assert!(
        wait_until(Duration::from_secs(10), || {
            text = s.get("/metrics").text().expect("metrics");
            text.contains("treewarden_kill_authorizations_written_total 1")
                && text.contains("treewarden_scan_duration_seconds_count")
        }),
        "{text}"
    );
    let scraped: BTreeSet<String> = text
        .lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
        .filter_map(|l| l.split(['{', ' ']).next().map(String::from))
        .collect();
    let dash: Value =
        serde_json::from_str(&read("deploy/grafana/treewarden.json")).expect("dashboard json");
    for (what, used) in [
        (
            "deploy/prometheus/treewarden-rules.yml",
            metric_names(&read("deploy/prometheus/treewarden-rules.yml")),
        ),
        (
            "deploy/grafana/treewarden.json",
            metric_names(&dashboard_queries(&dash).join("\n")),
        ),
    ] {
        assert!(used.len() >= 5, "{what}: only {used:?}");
        let missing: Vec<&String> = used.iter().filter(|n| !scraped.contains(*n)).collect();
        assert!(
            missing.is_empty(),
            "{what} uses {missing:?}, which a live /metrics does not export:\n{text}"
        );
    }
    // The metric the threat model and FLEET.md rely on for the published head.
    assert!(scraped.contains("treewarden_ledger_head_seq"));
}

#[test]
fn promtool_checks_the_rules_the_config_the_rule_tests_and_the_dashboard_queries() {
    let Some(promtool) = tool("promtool") else {
        skip("promtool not installed (Debian package prometheus)");
        return;
    };
    let dir = repo().join("deploy/prometheus");
    let promtool_ok = |args: &[&str], cwd: &Path| {
        let mut cmd = Command::new(&promtool);
        cmd.args(args).current_dir(cwd);
        let (code, out, err) = run_bounded(cmd, Duration::from_secs(60));
        assert_eq!(code, Some(0), "promtool {args:?}:\n{out}{err}");
        out
    };
    promtool_ok(&["check", "rules", "treewarden-rules.yml"], &dir);
    promtool_ok(&["check", "config", "prometheus.yml"], &dir);
    let out = promtool_ok(&["test", "rules", "treewarden-rules.test.yml"], &dir);
    assert!(out.contains("SUCCESS"), "{out}");
    // Each dashboard query, with Grafana's variables filled in, as a
    // recording rule: promtool parses it as PromQL.
    let dash: Value =
        serde_json::from_str(&read("deploy/grafana/treewarden.json")).expect("dashboard json");
    let tmp = tempfile::tempdir().expect("temp dir");
    let mut rules = String::from("groups:\n  - name: dashboard\n    rules:\n");
    let mut n = 0;
    for q in dashboard_queries(&dash) {
        if q.starts_with("label_values(") {
            continue;
        }
        n += 1;
        let expr = q
            .replace("$__rate_interval", "5m")
            .replace("$instance", ".*")
            .replace("$host", ".*");
        rules.push_str(&format!(
            "      - record: dashboard:query_{n}\n        expr: {}\n",
            serde_json::to_string(&expr).expect("quote")
        ));
    }
    assert!(n >= 12, "only {n} dashboard queries");
    std::fs::write(tmp.path().join("dashboard.yml"), rules).expect("write");
    promtool_ok(&["check", "rules", "dashboard.yml"], tmp.path());
}

#[test]
fn the_otel_collector_config_is_well_formed() {
    let check = r#"
import sys, yaml
c = yaml.safe_load(open(sys.argv[1]))
svc = c["service"]
for ext in svc.get("extensions", []):
    assert ext in c["extensions"], ext
for name, p in svc["pipelines"].items():
    for kind in ("receivers", "processors", "exporters"):
        for comp in p.get(kind, []):
            assert comp in c[kind], f"{name}: {kind} {comp} not defined"
    assert "batch" in p["processors"], name
    assert any(e.startswith("otlphttp") for e in p["exporters"]), name
assert "traces" in svc["pipelines"] and "logs" in svc["pipelines"]
assert c["receivers"]["otlp"]["protocols"]["http"]["endpoint"].startswith("127.0.0.1:")
assert c["exporters"]["otlphttp/central"]["endpoint"].startswith("${env:")
print("ok")
"#;
    let has_yaml = Command::new("python3")
        .args(["-c", "import yaml"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if !has_yaml {
        skip("python3 with PyYAML not installed (Debian package python3-yaml)");
        return;
    }
    let mut cmd = Command::new("python3");
    cmd.args(["-c", check])
        .arg(repo().join("deploy/otel-collector.yaml"));
    let (code, out, err) = run_bounded(cmd, Duration::from_secs(30));
    assert_eq!(code, Some(0), "{out}{err}");
    if let Some(otelcol) = tool("otelcol-contrib") {
        let mut cmd = Command::new(otelcol);
        cmd.args(["validate", "--config"])
            .arg(repo().join("deploy/otel-collector.yaml"))
            .env("TREEWARDEN_OTLP_CENTRAL_ENDPOINT", "http://127.0.0.1:4318");
        let (code, out, err) = run_bounded(cmd, Duration::from_secs(30));
        assert_eq!(code, Some(0), "otelcol-contrib validate:\n{out}{err}");
    } else {
        skip("otelcol-contrib not installed: structure checked, not validated by the collector");
    }
}

#[test]
fn every_deploy_and_docs_path_the_docs_mention_exists() {
    let mut docs = vec!["README.md".to_string()];
    for e in std::fs::read_dir(repo().join("docs"))
        .expect("docs")
        .flatten()
    {
        if e.path().extension().is_some_and(|x| x == "md") {
            docs.push(format!("docs/{}", e.file_name().to_string_lossy()));
        }
    }
    let mut checked = 0;
    for doc in &docs {
        let text = read(doc);
        for prefix in ["deploy/", "docs/", "examples/"] {
            let mut rest = text.as_str();
            while let Some(at) = rest.find(prefix) {
                let before = rest[..at].chars().last();
                let link = rest[..at].ends_with("](");
                let tail = &rest[at..];
                let end = tail
                    .find(|c: char| !(c.is_ascii_alphanumeric() || "/._-".contains(c)))
                    .unwrap_or(tail.len());
                let path = tail[..end].trim_end_matches(['.', '/']);
                rest = &tail[end..];
                // Only repository paths: not part of a longer path or URL,
                // nor a path at a named commit (`git show <rev>:docs/…`).
                if before.is_some_and(|c| c.is_ascii_alphanumeric() || "/._-:".contains(c))
                    || !path.contains('.')
                {
                    continue;
                }
                // A markdown link target is relative to the document.
                let base = if link {
                    repo().join(doc).parent().expect("doc dir").to_path_buf()
                } else {
                    repo()
                };
                assert!(
                    base.join(path).exists(),
                    "{doc} mentions {path}, which does not exist"
                );
                checked += 1;
            }
        }
    }
    assert!(checked >= 5, "only {checked} paths found");
}

/// Every byte of README.md and docs/*.md is printable text or a newline: no
/// TAB, no escape, no BEL (a `\t` or `\a` lost in an edit once turned
/// `C:\tw` and `\api-token` into control characters).
#[test]
fn the_readme_and_docs_hold_no_control_characters() {
    let mut docs = vec!["README.md".to_string()];
    for e in std::fs::read_dir(repo().join("docs"))
        .expect("docs")
        .flatten()
    {
        if e.path().extension().is_some_and(|x| x == "md") {
            docs.push(format!("docs/{}", e.file_name().to_string_lossy()));
        }
    }
    assert!(docs.len() > 5, "{docs:?}");
    for doc in &docs {
        let bytes = std::fs::read(repo().join(doc)).expect("read");
        for (n, line) in bytes.split(|&b| b == b'\n').enumerate() {
            if let Some(&b) = line.iter().find(|&&b| b < 0x20 || b == 0x7f) {
                panic!(
                    "{doc}:{}: control character 0x{b:02x} in {:?}",
                    n + 1,
                    String::from_utf8_lossy(line)
                );
            }
        }
    }
}

/// The ```sh blocks of a markdown text, in order.
fn shell_blocks(text: &str) -> Vec<String> {
    let mut blocks = Vec::new();
    let mut current: Option<String> = None;
    for line in text.lines() {
        match (&mut current, line.trim_start()) {
            (None, "```sh") => current = Some(String::new()),
            (Some(_), "```") => blocks.extend(current.take()),
            (Some(b), _) => {
                b.push_str(line);
                b.push('\n');
            }
            (None, _) => {}
        }
    }
    blocks
}

/// Every shell example of README.md runs, in order, as written, and ends
/// as the README says (a `# exits N` comment, else 0), under `set -e -o
/// pipefail`, so a failing line fails its block. What the test changes, and
/// only that:
/// - `cargo run --release --` is a shell function that runs the binary
///   `cargo test` built (a release build here would cost minutes; the
///   program is the same);
/// - the ledger is this test's (`TREEWARDEN_DATA_DIR`, and `/tmp/tw` is a
///   directory of this test), and the test's own cgroup root;
/// - `serve` listens on a port the kernel picks (`--listen 127.0.0.1:0
///   --ready-file`), runs in the background while the blocks after it run
///   (`7878` in them is that port), and is ended by its pid with SIGTERM,
///   which must exit 0.
///
/// The block that is the test command itself (`tests/run`) is the one not
/// run here: it is what runs this test.
#[test]
fn every_shell_example_in_the_readme_runs_as_written() {
    if tool("curl").is_none() {
        skip("curl is not installed (tests/setup installs it)");
        return;
    }
    let env = env();
    let tw = env.dir().join("tw");
    let ready = env.dir().join("ready");
    let blocks = shell_blocks(&read("README.md"));
    assert!(blocks.len() >= 4, "{blocks:?}");
    let cargo = format!(
        "cargo() {{ if [ \"$1 $2 $3\" != 'run --release --' ]; then echo \"README test: not a cargo run: $*\" >&2; return 99; fi; shift 3; {:?} \"$@\"; }}\n",
        bin()
    );
    let mut not_run = Vec::new();
    let mut ran = 0;
    let mut port: Option<String> = None;
    struct Serve(Option<std::process::Child>);
    impl Drop for Serve {
        fn drop(&mut self) {
            if let Some(child) = &mut self.0 {
                crate::util::signal(child.id(), rustix::process::Signal::TERM);
                if wait_child(child, Duration::from_secs(30)).is_none() {
                    let _ = child.kill();
                    let _ = child.wait();
                }
            }
        }
    }
    let mut serve = Serve(None);
    for block in &blocks {
        if block.trim() == "tests/run" {
            not_run.push(block.clone());
            continue;
        }
        let mut text = block.replace("/tmp/tw", &tw.display().to_string());
        if let Some(port) = &port {
            text = text.replace("7878", port);
        }
        let expected: i32 = block
            .split("# exits ")
            .nth(1)
            .and_then(|rest| rest.split_whitespace().next())
            .map(|n| n.parse().expect("a number after '# exits'"))
            .unwrap_or(0);
        if let Some(at) = text.find(" serve") {
            assert!(serve.0.is_none(), "one serve block");
            let end = at + " serve".len();
            text.insert_str(
                end,
                &format!(" --listen 127.0.0.1:0 --ready-file {}", ready.display()),
            );
            // The service's block is one command: its `cargo run` execs the
            // binary, so the pid to signal is the service's own.
            let exec = cargo.replace("shift 3; ", "shift 3; exec ");
            let mut cmd = env.cmd_for("bash");
            cmd.arg("-c")
                .arg(format!("set -e -o pipefail\n{exec}{text}"))
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::from(
                    std::fs::File::create(env.dir().join("serve.err")).expect("log"),
                ));
            serve.0 = Some(cmd.spawn().expect("serve block"));
            assert!(
                wait_until(Duration::from_secs(30), || {
                    std::fs::read_to_string(&ready).is_ok_and(|s| s.contains(':'))
                        && tw.join("api.sock").exists()
                }),
                "serve did not come up: {}",
                std::fs::read_to_string(env.dir().join("serve.err")).unwrap_or_default()
            );
            let addr = std::fs::read_to_string(&ready).expect("ready file");
            port = Some(addr.trim().rsplit(':').next().expect("a port").to_string());
            ran += 1;
            continue;
        }
        let mut cmd = env.cmd_for("bash");
        cmd.arg("-c")
            .arg(format!("set -e -o pipefail\n{cargo}{text}"));
        let (code, out, err) = run_bounded(cmd, Duration::from_secs(60));
        assert_eq!(
            code,
            Some(expected),
            "README block\n{block}\nexited {code:?}, not {expected}:\n{out}\n{err}"
        );
        ran += 1;
    }
    assert_eq!(
        not_run.len(),
        1,
        "only the test command is not run: {not_run:?}"
    );
    assert!(serve.0.is_some(), "the service's block was found and run");
    let mut child = serve.0.take().expect("serve");
    crate::util::signal(child.id(), rustix::process::Signal::TERM);
    let status = wait_child(&mut child, Duration::from_secs(30)).expect("serve exits on SIGTERM");
    assert_eq!(
        status.code(),
        Some(0),
        "{}",
        std::fs::read_to_string(env.dir().join("serve.err")).unwrap_or_default()
    );
    assert!(ran >= 4, "{ran} blocks ran");
    // What the examples started is over: no tree of either ledger is alive.
    for data in [env.data_dir(), tw.clone()] {
        let out = env
            .cmd()
            .arg("--data-dir")
            .arg(&data)
            .args(["ls", "--json"])
            .output()
            .expect("ls");
        let live: Value = serde_json::from_slice(&out.stdout).expect("ls --json");
        assert_eq!(live.as_array().map(Vec::len), Some(0), "{live}");
    }
}

/// A fleet's hosts are told apart by a `host` label their scrapers add (all
/// of them may be `127.0.0.1:7878`): no alert may aggregate it away, no
/// summary may name only the instance, and every board query keeps it.
#[test]
fn alerts_and_the_board_keep_the_host_label() {
    let rules = read("deploy/prometheus/treewarden-rules.yml");
    for (name, block) in alerts(&rules) {
        for (at, _) in block.match_indices(" by (") {
            let clause = &block[at..at + block[at..].find(')').expect("by clause")];
            assert!(
                clause.contains("host") && clause.contains("instance"),
                "{name} aggregates `{clause})`, dropping the host or the instance"
            );
        }
        let summary = block
            .lines()
            .find(|l| l.trim_start().starts_with("summary:"))
            .expect("summary");
        assert!(
            summary.contains("$labels.host"),
            "{name}'s summary does not name the host: {summary}"
        );
    }
    let dash: Value =
        serde_json::from_str(&read("deploy/grafana/treewarden.json")).expect("dashboard json");
    let mut table = false;
    for p in dash["panels"].as_array().expect("panels") {
        table |= p["type"] == "table" && p["title"] == "Hosts";
        for t in p["targets"].as_array().into_iter().flatten() {
            let expr = t["expr"].as_str().expect("expr");
            assert!(expr.contains("host=~\"$host\""), "{}: {expr}", p["title"]);
            if p["type"] == "timeseries" {
                for (at, _) in expr.match_indices(" by (") {
                    let clause = &expr[at..at + expr[at..].find(')').expect("by")];
                    assert!(clause.contains("host"), "{}: {expr}", p["title"]);
                }
                assert!(
                    t["legendFormat"]
                        .as_str()
                        .is_some_and(|l| l.contains("{{host}}")),
                    "{}: its legend does not name the host",
                    p["title"]
                );
            }
        }
    }
    assert!(table, "no per-host table");
    assert!(
        dash["templating"]["list"]
            .as_array()
            .expect("vars")
            .iter()
            .any(|v| v["name"] == "host"),
        "no host variable"
    );
}
