//! `export --format ocsf`: a real ledger made by real `run`s (argv markers,
//! a known exit code, a timeout's forced kill), exported as OCSF 1.5.0
//! Process Activity and compared field by field with what the workloads
//! printed and with the NDJSON export each record names (seq, hash); every
//! line validated by the PyPI package `ocsf-emitter==0.3.0` (tests/setup
//! installs it), or the test says "skipped: <why>". A tree killed over the
//! API with a second token: its teardown's records name that token, as its
//! `kill.requested` records it, and not the one that spawned it.

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

use serde_json::Value;

use crate::custody::Env;
use crate::seal::{text, tw};
use crate::util::{bin, end_marked, pid_alive, printed_pids, say, skip, wait_child, wait_until};

/// Validates each line of the file with ocsf-emitter; exit 3 with a
/// `skipped:` line when the package is not there to do it. A record made
/// wrong on purpose must fail, so a validator that takes anything cannot
/// pass for one.
const VALIDATE: &str = r#"
import json, sys
try:
    import importlib.metadata as meta
    import ocsf_emitter
    from ocsf_emitter import models, validate
    version = meta.version("ocsf-emitter")
except Exception as e:
    print(f"skipped: ocsf-emitter cannot be imported ({type(e).__name__}: {e})")
    sys.exit(3)
if version != "0.3.0":
    print(f"skipped: ocsf-emitter {version} is installed, not 0.3.0")
    sys.exit(3)
records = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
bad = []
for i, r in enumerate(records, 1):
    try:
        validate(models.ProcessActivity.model_validate(r))
    except Exception as e:
        bad.append(f"line {i}: {e}")
    if not any(r["actor"].get(k) for k in ("process", "user", "session", "app_name")):
        bad.append(f"line {i}: the actor names nobody")
wrong = dict(records[0], type_uid=records[0]["class_uid"] * 100 + 3)
try:
    validate(models.ProcessActivity.model_validate(wrong))
    bad.append("a record with a wrong type_uid passed")
except Exception:
    pass
if bad:
    print("\n".join(bad))
    sys.exit(1)
print(f"validated {len(records)} records against OCSF {ocsf_emitter.OCSF_SCHEMA_VERSION}")
"#;

/// `treewarden run` in the background (its own pid is the CLI requester's),
/// then its exit code.
fn run(data: &Path, args: &[&str]) -> (u32, Option<i32>, String) {
    let err = tempfile::NamedTempFile::new().expect("stderr file");
    let mut child = Command::new(bin())
        .arg("--data-dir")
        .arg(data)
        .arg("run")
        .args(args)
        .env_remove("TREEWARDEN_DATA_DIR")
        .env_remove("TREEWARDEN_LOG")
        .env("TREEWARDEN_BOUNDARY", "session")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(err.reopen().expect("stderr"))
        .spawn()
        .expect("run");
    let pid = child.id();
    let status = wait_child(&mut child, Duration::from_secs(60));
    let stderr = std::fs::read_to_string(err.path()).unwrap_or_default();
    (pid, status.and_then(|s| s.code()), stderr)
}

fn lines(body: &str) -> Vec<Value> {
    body.lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| serde_json::from_str(l).expect("a JSON line"))
        .collect()
}

/// The records that came from events of `kind` in `tree`.
fn of<'a>(records: &'a [Value], tree: i64, kind: &str) -> Vec<&'a Value> {
    records
        .iter()
        .filter(|r| {
            r["unmapped"]["treewarden"]["tree"] == tree
                && r["unmapped"]["treewarden"]["kind"] == kind
        })
        .collect()
}

/// The epoch milliseconds of a ledger time.
fn millis(at: &str) -> u64 {
    humantime::parse_rfc3339(at)
        .expect("an RFC 3339 time")
        .duration_since(std::time::UNIX_EPOCH)
        .expect("after 1970")
        .as_millis() as u64
}

#[test]
fn an_ocsf_export_of_real_runs_matches_the_ledger_and_validates() {
    let env = Env::new("session").expect("the session boundary always forms");
    let data = env.data_dir();
    let mark = format!("TW_TEST_MARK={}", env.mark);
    let pid_a = env.dir().join("a.pid");
    let pid_b = env.dir().join("b.pid");
    let script_a = format!("echo $$ > {}; exit 3", pid_a.display());
    let (run_a, code, err) = run(
        &data,
        &[
            "--quiet",
            "--env",
            &mark,
            "--",
            "sh",
            "-c",
            &script_a,
            "ocsf-marker-a",
        ],
    );
    assert_eq!(code, Some(3), "{err}");
    // Ignores SIGTERM (kept across exec): the timeout's teardown must
    // force-kill it under an authorization.
    let script_b = format!("trap '' TERM; echo $$ > {}; exec sleep 60", pid_b.display());
    let (run_b, code, err) = run(
        &data,
        &[
            "--quiet",
            "--timeout",
            "1s",
            "--grace",
            "300ms",
            "--env",
            &mark,
            "--",
            "sh",
            "-c",
            &script_b,
            "ocsf-marker-b",
        ],
    );
    assert_eq!(code, Some(124), "{err}");
    let root_a = printed_pids(&pid_a, 1)[0];
    let root_b = printed_pids(&pid_b, 1)[0];
    assert!(end_marked(&env.mark).is_empty(), "nothing outlived its run");

    let out = tw(&data, &["export", "--format", "ocsf"]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    let stderr = text(&out.stderr);
    let records = lines(&text(&out.stdout));
    let whole = tw(&data, &["export"]);
    assert_eq!(whole.status.code(), Some(0), "{}", text(&whole.stderr));
    let events: Vec<Value> = lines(&text(&whole.stdout))
        .into_iter()
        .filter(|l| l.get("seq").is_some())
        .collect();
    let skipped = events.len() - records.len();
    if skipped > 0 {
        assert!(
            stderr.contains(&format!("{skipped} events of other kinds left out")),
            "the left-out count on stderr: {stderr}"
        );
    }

    // Every record: the class, its identity, and the event it names.
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname").expect("hostname");
    let host = host.trim();
    let machine = std::fs::read_to_string("/etc/machine-id")
        .ok()
        .map(|m| m.trim().to_string());
    assert!(records.len() >= 6, "{records:?}");
    for r in &records {
        let origin = &r["unmapped"]["treewarden"];
        let seq = origin["seq"].as_i64().expect("each record names its seq");
        let event = events
            .iter()
            .find(|e| e["seq"] == seq)
            .expect("the seq is the NDJSON export's");
        assert_eq!(origin["hash"], event["hash"], "{r}");
        assert_eq!(origin["kind"], event["kind"], "{r}");
        assert_eq!(r["class_uid"], 1007, "{r}");
        assert_eq!(r["category_uid"], 1, "{r}");
        let activity = r["activity_id"].as_u64().expect("activity_id");
        assert_eq!(r["type_uid"], 100_700 + activity, "{r}");
        assert!(r["severity_id"].is_u64(), "{r}");
        assert_eq!(r["time"], millis(event["at"].as_str().expect("at")), "{r}");
        assert_eq!(r["metadata"]["version"], "1.5.0", "{r}");
        assert_eq!(r["metadata"]["product"]["name"], "treewarden", "{r}");
        assert!(r["metadata"]["product"]["vendor_name"].is_string(), "{r}");
        assert!(r["metadata"]["product"]["version"].is_string(), "{r}");
        assert_eq!(r["metadata"]["uid"], format!("{host}:{seq}"), "{r}");
        assert_eq!(r["device"]["hostname"], host, "{r}");
        assert!(r["device"]["type_id"].is_u64(), "{r}");
        if let Some(machine) = &machine {
            assert_eq!(r["device"]["uid"], machine.as_str(), "{r}");
        }
        assert!(r["actor"].is_object() && r["process"].is_object(), "{r}");
    }

    // The ground truth: the trees in the order they ran.
    let mut trees: Vec<i64> = events.iter().filter_map(|e| e["tree"].as_i64()).collect();
    trees.dedup();
    let (tree_a, tree_b) = (trees[0], trees[1]);
    for (tree, root, marker, runner) in [
        (tree_a, root_a, "ocsf-marker-a", run_a),
        (tree_b, root_b, "ocsf-marker-b", run_b),
    ] {
        let launch = of(&records, tree, "tree.created");
        assert_eq!(launch.len(), 1, "one launch of tree {tree}");
        let l = launch[0];
        assert_eq!(l["activity_id"], 1, "{l}");
        assert_eq!(
            l["process"]["pid"], root,
            "the pid the workload printed: {l}"
        );
        assert_eq!(l["process"]["name"], "sh", "{l}");
        let cmd = l["process"]["cmd_line"].as_str().expect("cmd_line");
        assert!(cmd.starts_with("sh -c ") && cmd.ends_with(marker), "{cmd}");
        assert!(
            l["process"]["uid"]
                .as_str()
                .is_some_and(|u| u.contains(&format!(":{root}:")))
        );
        assert_eq!(l["status_id"], 1, "spawned: {l}");
        // The actor is the CLI that asked: root, in the run process.
        assert_eq!(l["actor"]["user"]["uid"], "0", "{l}");
        assert_eq!(l["actor"]["process"]["pid"], runner, "{l}");
        let ended = of(&records, tree, "tree.ended");
        assert_eq!(ended.len(), 1, "tree {tree}");
        assert_eq!(ended[0]["activity_id"], 2, "{}", ended[0]);
        assert_eq!(ended[0]["process"]["pid"], root, "{}", ended[0]);
    }
    let ended_a = of(&records, tree_a, "tree.ended")[0];
    assert_eq!(ended_a["exit_code"], 3, "the exit code it chose: {ended_a}");
    // It ended on its own: the root is the actor.
    assert_eq!(ended_a["actor"]["process"]["pid"], root_a, "{ended_a}");
    assert!(
        of(&records, tree_a, "kill.authorized").is_empty(),
        "tree {tree_a} was never force-killed"
    );
    // The forced kill: its authorization and its SIGKILL, each a Terminate
    // of the root whose actor is the tree's principal (no kill request:
    // the CLI that ran it).
    let authorized = of(&records, tree_b, "kill.authorized");
    assert_eq!(authorized.len(), 1, "{records:?}");
    let a = authorized[0];
    assert_eq!(a["activity_id"], 2, "{a}");
    assert_eq!(a["process"]["pid"], root_b, "{a}");
    assert_eq!(a["actor"]["user"]["uid"], "0", "{a}");
    assert_eq!(a["actor"]["process"]["pid"], run_b, "{a}");
    let sources = a["unmapped"]["treewarden"]["sources"]
        .as_array()
        .expect("sources");
    assert!(
        sources.iter().any(|s| s["kind"] == "tree.created"),
        "the principal's event named: {a}"
    );
    let kills: Vec<&Value> = of(&records, tree_b, "signal.sent")
        .into_iter()
        .filter(|s| s["unmapped"]["treewarden"]["signal"] == "SIGKILL")
        .collect();
    assert!(!kills.is_empty(), "a SIGKILL record");
    for k in &kills {
        assert_eq!(k["activity_id"], 2, "{k}");
        assert_eq!(k["process"]["pid"], root_b, "{k}");
        assert_eq!(
            k["unmapped"]["treewarden"]["authorization"],
            a["unmapped"]["treewarden"]["authorization"],
            "{k}"
        );
        assert_eq!(k["actor"]["process"]["pid"], run_b, "{k}");
    }
    let ended_b = of(&records, tree_b, "tree.ended")[0];
    assert!(ended_b["exit_code"].is_null(), "killed, no code: {ended_b}");
    assert_eq!(
        ended_b["actor"]["process"]["pid"], run_b,
        "torn down: {ended_b}"
    );

    // A filtered OCSF export holds exactly the filter's records.
    let out = tw(
        &data,
        &["export", "--format", "ocsf", "--tree", &tree_b.to_string()],
    );
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    let filtered = lines(&text(&out.stdout));
    let want: Vec<&Value> = records
        .iter()
        .filter(|r| r["unmapped"]["treewarden"]["tree"] == tree_b)
        .collect();
    assert_eq!(filtered.iter().collect::<Vec<_>>(), want);

    // A bad --format: clap's refusal, naming the value and the formats, exit 2.
    let out = tw(&data, &["export", "--format", "xml"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(out.stdout.is_empty());
    let err = text(&out.stderr);
    assert!(
        err.contains("'xml'") && err.contains("possible values: ndjson, csv, ocsf"),
        "{err}"
    );

    // Every line validated against OCSF 1.5.0 by the package.
    let file = env.dir().join("ocsf.ndjson");
    let mut body = String::new();
    for r in &records {
        body.push_str(&r.to_string());
        body.push('\n');
    }
    std::fs::write(&file, body).expect("write the OCSF export");
    validate(&file);
}

/// Runs [`VALIDATE`] on `file`: passes, fails naming the lines, or says
/// why it is skipped.
pub(crate) fn validate(file: &Path) {
    let out = match Command::new("python3")
        .arg("-c")
        .arg(VALIDATE)
        .arg(file)
        .stdin(Stdio::null())
        .output()
    {
        Ok(out) => out,
        Err(e) => {
            skip(&format!("OCSF validation: python3 cannot run ({e})"));
            return;
        }
    };
    let said = text(&out.stdout);
    match out.status.code() {
        Some(0) => say(&format!("ocsf: {}", said.trim())),
        Some(3) => skip(&format!(
            "OCSF validation: {}",
            said.trim().trim_start_matches("skipped: ")
        )),
        _ => panic!("OCSF validation failed: {said} {}", text(&out.stderr)),
    }
}

#[test]
fn the_api_serves_the_same_ocsf_view_as_the_cli_and_an_empty_one_when_nothing_matches() {
    let server = crate::serve::Server::start(&[]);
    // No process activity yet: 200 and an empty body, not an error.
    let r = server.get("/api/export?format=ocsf");
    assert_eq!(r.status().as_u16(), 200);
    assert_eq!(r.text().expect("body"), "");
    let r = server
        .get("/api/export?format=ocsf&since=0025-09-23T02:17:38.150Z&until=1532-01-09T11:10:44Z");
    assert_eq!(r.status().as_u16(), 200);
    assert_eq!(r.text().expect("body"), "");
    let id = crate::jetstream::spawn_ended(&server, "ocsf-api");
    let r = server.get("/api/export?format=ocsf");
    assert_eq!(r.status().as_u16(), 200);
    let api = lines(&r.text().expect("body"));
    let launch = of(&api, id, "tree.created");
    assert_eq!(launch.len(), 1, "the tree's launch: {api:?}");
    assert_eq!(launch[0]["activity_id"], 1);
    assert_eq!(of(&api, id, "tree.ended").len(), 1, "its end: {api:?}");
    let cli = tw(&server.data_dir(), &["export", "--format", "ocsf"]);
    assert_eq!(cli.status.code(), Some(0), "{}", text(&cli.stderr));
    assert_eq!(api, lines(&text(&cli.stdout)));
}

#[test]
fn an_api_kills_teardown_records_name_its_requester_as_the_actor() {
    let s = crate::serve::Server::start(&[]);
    let (token_id, token) = crate::session::make_token(&s, "admin", "ocsf-oncall");
    // Spawned with the harness's token; TERM ignored (kept across exec),
    // so the teardown needs an authorization and a SIGKILL.
    let id = s.spawn(&s.body("trap '' TERM; echo $$ > ocsf-root.pid; exec sleep 300"));
    let root = printed_pids(&s.dir.path().join("ocsf-root.pid"), 1)[0];
    assert!(
        wait_until(Duration::from_secs(20), || {
            s.tree(id)["members"]
                .as_array()
                .is_some_and(|m| !m.is_empty())
        }),
        "no member recorded: {}",
        s.tree(id)
    );
    let r = reqwest::blocking::Client::builder()
        .no_proxy()
        .build()
        .expect("client")
        .post(s.url(&format!("/api/trees/{id}/kill?grace=100ms")))
        .bearer_auth(&token)
        .send()
        .expect("kill");
    assert_eq!(r.status(), 200);
    let kill: Value = r.json().expect("json");
    assert_eq!(kill["state"], "ended", "{kill}");
    assert!(!pid_alive(root), "the root {root} was killed");

    // The request as the ledger records it: the kill's token.
    let whole = tw(&s.data_dir(), &["export"]);
    assert_eq!(whole.status.code(), Some(0), "{}", text(&whole.stderr));
    let events = lines(&text(&whole.stdout));
    let requested: Vec<&Value> = events
        .iter()
        .filter(|e| e["tree"] == id && e["kind"] == "kill.requested")
        .collect();
    assert_eq!(requested.len(), 1, "one kill request: {events:?}");
    let request = requested[0];
    let by = &request["data"]["by"];
    assert_eq!(by["via"], "tcp", "{request}");
    assert_eq!(by["token_id"], token_id, "{request}");
    assert_eq!(by["token_name"], "ocsf-oncall", "{request}");

    let out = tw(
        &s.data_dir(),
        &["export", "--format", "ocsf", "--tree", &id.to_string()],
    );
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    let records = lines(&text(&out.stdout));
    let kills: Vec<&Value> = of(&records, id, "signal.sent")
        .into_iter()
        .filter(|r| r["unmapped"]["treewarden"]["signal"] == "SIGKILL")
        .collect();
    assert!(!kills.is_empty(), "a SIGKILL record: {records:?}");
    let teardown: Vec<&Value> = [
        of(&records, id, "signal.sent"),
        of(&records, id, "kill.authorized"),
        of(&records, id, "tree.ended"),
    ]
    .concat();
    assert!(
        of(&records, id, "kill.authorized").len() == 1 && of(&records, id, "tree.ended").len() == 1,
        "{records:?}"
    );
    for r in &teardown {
        let actor = &r["actor"];
        assert_eq!(actor["user"]["uid"], format!("token:{token_id}"), "{r}");
        assert_eq!(actor["user"]["name"], "ocsf-oncall", "{r}");
        assert_eq!(actor["app_name"], "treewarden tcp", "{r}");
        assert!(actor.get("process").is_none(), "no pid over TCP: {r}");
        let origin = &r["unmapped"]["treewarden"];
        assert_eq!(&origin["by"], by, "the request's principal: {r}");
        assert!(
            origin["sources"].as_array().is_some_and(|s| s
                .iter()
                .any(|s| s["seq"] == request["seq"] && s["hash"] == request["hash"])),
            "the kill.requested it came from: {r}"
        );
        assert_eq!(r["process"]["pid"], root, "{r}");
    }
    // The launch's actor is the token that spawned it, not the kill's.
    let launch = of(&records, id, "tree.created");
    assert_eq!(launch.len(), 1, "{records:?}");
    let spawner = &launch[0]["actor"]["user"]["uid"];
    assert!(
        spawner.as_str().is_some_and(|u| u.starts_with("token:")),
        "{}",
        launch[0]
    );
    assert_ne!(spawner, &format!("token:{token_id}"), "{}", launch[0]);

    let file = s.dir.path().join("ocsf-api-kill.ndjson");
    let mut body = String::new();
    for r in &records {
        body.push_str(&r.to_string());
        body.push('\n');
    }
    std::fs::write(&file, body).expect("write the OCSF export");
    validate(&file);
}
