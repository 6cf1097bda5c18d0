//! The service end to end: the real `treewarden serve` on 127.0.0.1:0,
//! driven over plain HTTP (and by chromium, promtool and schemathesis where
//! installed; each such test prints "skipped: <why>" when its tool is
//! missing, and `.ci/run` installs them).
//!
//! The server writes its bound address to `--ready-file`; tests poll for
//! it. Every tree a test spawns carries a unique `TW_TEST_MARK` in its
//! environment, so survivors are found independently of treewarden and
//! ended by pid at the end (and by `Drop`, the last line of defence).
//! Only 127.0.0.1 is ever contacted.

use std::io::{BufReader, Read, Write};
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::{Value, json};

use crate::util::{KillOnDrop, bin, say, signal, skip, wait_child, wait_until};

static SEQ: AtomicUsize = AtomicUsize::new(0);

/// One running `treewarden serve` with its own data dir.
pub(crate) struct Server {
    pub(crate) dir: tempfile::TempDir,
    /// This server's own cgroup root (cgroup boundary, as root), so tree
    /// cgroups of servers running side by side never collide.
    cgroup_root: Option<PathBuf>,
    /// A filesystem mounted on the data dir ([`Server::start_on_tmpfs`]),
    /// unmounted when the server is dropped, before its temp dir goes.
    mounted: Option<PathBuf>,
    child: Option<Child>,
    pub(crate) addr: String,
    pub(crate) token: String,
    pub(crate) mark: String,
    http: reqwest::blocking::Client,
}

impl Server {
    pub(crate) fn start(extra: &[&str]) -> Server {
        Self::start_with_env(extra, &[])
    }

    pub(crate) fn start_with_env(extra: &[&str], env: &[(&str, &str)]) -> Server {
        Self::start_full(extra, env, None, None, None)
    }

    /// A server started with `cwd` as its working directory (it moves to
    /// `/` itself).
    pub(crate) fn start_in(cwd: &Path, extra: &[&str]) -> Server {
        Self::start_full(extra, &[], None, Some(cwd), None)
    }

    /// A server whose data dir is a fresh tmpfs of `size` (`mount -t tmpfs
    /// -o size=...`), unmounted on every path (the server's drop, or a
    /// failed start). `None` after a "skipped:" line where it cannot be
    /// mounted (not root, no mount).
    pub(crate) fn start_on_tmpfs(extra: &[&str], size: &str) -> Option<Server> {
        if !crate::util::is_root() {
            skip("a tmpfs data dir needs root (mount)");
            return None;
        }
        let dir = tempfile::tempdir().expect("temp dir");
        let data = dir.path().join("data");
        std::fs::create_dir(&data).expect("data dir");
        let mounted = Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={size}"), "tmpfs"])
            .arg(&data)
            .status()
            .is_ok_and(|s| s.success());
        if !mounted {
            skip("mount -t tmpfs failed");
            return None;
        }
        // Unmounted by this guard if the start panics, by the server's drop after.
        struct Unmount(Option<PathBuf>);
        impl Drop for Unmount {
            fn drop(&mut self) {
                if let Some(p) = self.0.take() {
                    let _ = Command::new("umount").arg("-l").arg(&p).status();
                }
            }
        }
        let mut guard = Unmount(Some(data.clone()));
        let server = Self::start_full(extra, &[], None, None, Some((dir, data)));
        // The server unmounts it now.
        guard.0 = None;
        Some(server)
    }

    /// A server whose data dir starts with a copy of the ledger at `seed`.
    pub(crate) fn start_seeded(seed: &Path, extra: &[&str]) -> Server {
        Self::start_full(extra, &[], Some(seed), None, None)
    }

    fn start_full(
        extra: &[&str],
        env: &[(&str, &str)],
        seed: Option<&Path>,
        cwd: Option<&Path>,
        mounted: Option<(tempfile::TempDir, PathBuf)>,
    ) -> Server {
        let (dir, mounted) = match mounted {
            Some((dir, at)) => (dir, Some(at)),
            None => (tempfile::tempdir().expect("temp dir"), None),
        };
        if let Some(seed) = seed {
            use std::os::unix::fs::DirBuilderExt;
            let data = dir.path().join("data");
            std::fs::DirBuilder::new()
                .mode(0o700)
                .create(&data)
                .expect("data dir");
            std::fs::copy(seed, data.join("ledger.db")).expect("seed the ledger");
        }
        let n = SEQ.fetch_add(1, Ordering::SeqCst);
        let mark = format!("tw-serve-{}-{n}", std::process::id());
        let ready = dir.path().join("addr");
        let err = std::fs::File::create(dir.path().join("serve.stderr")).expect("stderr file");
        let cgroup_root = crate::custody::own_cgroup_dir()
            .filter(|_| crate::util::is_root())
            .map(|own| own.join(format!("tw-serve-test-{}-{n}", std::process::id())))
            .filter(|root| std::fs::create_dir(root).is_ok());
        let mut cmd = Command::new(bin());
        cmd.current_dir(cwd.unwrap_or(dir.path()))
            .env("TREEWARDEN_DATA_DIR", dir.path().join("data"))
            .env_remove("TREEWARDEN_CGROUP_ROOT")
            .env_remove("OTEL_EXPORTER_OTLP_ENDPOINT")
            .env_remove("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
            .env("TREEWARDEN_LOG", "info")
            .args(["serve", "--listen", "127.0.0.1:0"])
            .args(if extra.contains(&"--scan-interval") {
                &[][..]
            } else {
                &["--scan-interval", "100ms"][..]
            })
            .arg("--ready-file")
            .arg(&ready)
            .args(extra)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(err);
        match &cgroup_root {
            Some(root) => cmd
                .env("TREEWARDEN_BOUNDARY", "cgroup")
                .env("TREEWARDEN_CGROUP_ROOT", root),
            None => cmd.env("TREEWARDEN_BOUNDARY", "session"),
        };
        for (k, v) in env {
            cmd.env(k, v);
        }
        let child = cmd.spawn().expect("start treewarden serve");
        let mut server = Server {
            dir,
            cgroup_root,
            mounted,
            child: Some(child),
            addr: String::new(),
            token: String::new(),
            mark,
            http: reqwest::blocking::Client::builder()
                .no_proxy()
                .timeout(Duration::from_secs(60))
                .build()
                .expect("http client"),
        };
        let up = wait_until(Duration::from_secs(30), || ready.exists());
        assert!(up, "serve did not come up: {}", server.stderr());
        server.addr = std::fs::read_to_string(&ready).expect("ready file");
        server.token = std::fs::read_to_string(server.data_dir().join("api-token"))
            .expect("token")
            .trim()
            .to_string();
        server
    }

    pub(crate) fn data_dir(&self) -> PathBuf {
        self.dir.path().join("data")
    }

    /// The service's pid, while it runs.
    pub(crate) fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    pub(crate) fn stderr(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("serve.stderr")).unwrap_or_default()
    }

    pub(crate) fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.addr)
    }

    /// A GET with an `Accept` header (and the token): (status, body).
    pub(crate) fn http_get_with(&self, path: &str, accept: &str) -> Option<(u16, String)> {
        let r = self
            .http
            .get(self.url(path))
            .bearer_auth(&self.token)
            .header("accept", accept)
            .send()
            .ok()?;
        let status = r.status().as_u16();
        Some((status, r.text().ok()?))
    }

    /// A GET with the token (reads over TCP need one).
    pub(crate) fn get(&self, path: &str) -> reqwest::blocking::Response {
        self.http
            .get(self.url(path))
            .bearer_auth(&self.token)
            .send()
            .expect("GET")
    }

    /// A GET without any token.
    pub(crate) fn get_anon(&self, path: &str) -> reqwest::blocking::Response {
        self.http.get(self.url(path)).send().expect("GET")
    }

    fn get_json(&self, path: &str) -> Value {
        let r = self.get(path);
        assert_eq!(r.status(), 200, "GET {path}");
        r.json().expect("json")
    }

    pub(crate) fn post(&self, path: &str, body: Option<&Value>) -> (u16, Value) {
        let mut req = self.http.post(self.url(path)).bearer_auth(&self.token);
        if let Some(b) = body {
            req = req.json(b);
        }
        let r = req.send().expect("POST");
        let status = r.status().as_u16();
        (status, r.json().unwrap_or(Value::Null))
    }

    /// A spawn body whose tree carries this server's marker.
    /// A tree running `script` in this server's folder (the service itself
    /// works from `/`, which its trees would inherit).
    pub(crate) fn body(&self, script: &str) -> Value {
        json!({
            "argv": ["sh", "-c", script],
            "cwd": self.dir.path(),
            "env": { "TW_TEST_MARK": self.mark },
            "grace": "200ms",
            "label": "test",
        })
    }

    pub(crate) fn spawn(&self, body: &Value) -> i64 {
        let (status, v) = self.post("/api/trees", Some(body));
        assert_eq!(status, 201, "spawn answered {v}; log: {}", self.stderr());
        v["id"].as_i64().expect("tree id")
    }

    pub(crate) fn tree(&self, id: i64) -> Value {
        self.get_json(&format!("/api/trees/{id}"))
    }

    pub(crate) fn marked(&self) -> Vec<i32> {
        crate::util::marked_processes(&self.mark)
    }

    fn export(&self) -> Vec<Value> {
        let r = self.get("/api/export?format=ndjson");
        assert_eq!(r.status(), 200);
        crate::util::parse_ndjson(&r.text().expect("body"))
    }

    /// SIGTERM, then the exit status (bounded).
    pub(crate) fn terminate(&mut self) -> Option<std::process::ExitStatus> {
        let mut child = self.child.take()?;
        signal(child.id(), rustix::process::Signal::TERM);
        wait_child(&mut child, Duration::from_secs(40))
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
        crate::util::end_marked(&self.mark);
        if let Some(root) = &self.cgroup_root {
            // A tree left by a killed service (a test body without the
            // marker, or a failing test): end what its cgroup holds, by
            // cgroup, then remove the directories once the kernel lets go.
            for e in std::fs::read_dir(root).into_iter().flatten().flatten() {
                if e.path().is_dir() {
                    let _ = std::fs::write(e.path().join("cgroup.kill"), "1");
                }
            }
            // (`cgroup.kill` reaches below: a principal's parent, serve
            // --principal-*, holds its trees' cgroups, removed first.)
            let removed = wait_until(Duration::from_secs(10), || {
                for e in std::fs::read_dir(root).into_iter().flatten().flatten() {
                    if e.path().is_dir() {
                        for sub in std::fs::read_dir(e.path()).into_iter().flatten().flatten() {
                            if sub.path().is_dir() {
                                let _ = std::fs::remove_dir(sub.path());
                            }
                        }
                        let _ = std::fs::remove_dir(e.path());
                    }
                }
                std::fs::remove_dir(root).is_ok() || !root.exists()
            });
            if !removed {
                crate::util::say(&format!("test cgroup {} left behind", root.display()));
            }
        }
        if let Some(at) = self.mounted.take() {
            let _ = Command::new("umount").arg("-l").arg(&at).status();
        }
    }
}

fn artifacts() -> PathBuf {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("target/artifacts");
    std::fs::create_dir_all(&dir).expect("artifacts dir");
    dir
}

pub(crate) fn tool(name: &str) -> Option<PathBuf> {
    std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|p| p.join(name))
            .find(|p| p.is_file())
    })
}

/// A tree that ignores SIGTERM, so its teardown needs the forced kill.
const STUBBORN: &str = "trap '' TERM; sleep 300 & sleep 300 & wait";

/// Spawns a TERM-ignoring tree, waits until its members are in the ledger,
/// kills it through the API; returns the tree id.
pub(crate) fn spawn_and_kill(s: &Server) -> i64 {
    let id = s.spawn(&s.body(STUBBORN));
    assert!(
        wait_until(Duration::from_secs(20), || {
            s.tree(id)["members"].as_array().map_or(0, |m| m.len()) >= 3
        }),
        "members did not appear: {}",
        s.tree(id)
    );
    let (status, r) = s.post(&format!("/api/trees/{id}/kill?grace=100ms"), None);
    assert_eq!(status, 200, "kill answered {r}");
    assert_eq!(r["state"], "ended", "{r}");
    assert!(r["authorizations"].as_u64() >= Some(1), "{r}");
    id
}

#[test]
fn a_teardown_is_logged_once_though_the_root_exit_also_asks_for_one() {
    let s = Server::start_with_env(
        &[],
        &[("TREEWARDEN_LOG", "info,treewarden::custody::teardown=debug")],
    );
    let id = spawn_and_kill(&s);
    // The kill ends the root, whose exit the service also watches: that
    // second teardown finds the tree settled and says so at DEBUG only.
    let tree_field = format!("tree={id} ");
    let lines = |what: &str| {
        s.stderr()
            .lines()
            .filter(|l| l.contains(what) && l.contains(&tree_field))
            .count()
    };
    let second = wait_until(Duration::from_secs(5), || {
        lines("teardown: already settled") >= 1
    });
    if !second {
        say("the root-exit watcher asked for no second teardown this time");
    }
    assert_eq!(lines("teardown done"), 1, "{}", s.stderr());
}

#[test]
fn serve_spawns_sees_members_kills_and_exports_authority_before_the_sigkill() {
    let s = Server::start(&[]);
    let id = spawn_and_kill(&s);
    assert!(
        wait_until(Duration::from_secs(10), || s.marked().is_empty()),
        "survivors: {:?}",
        s.marked()
    );
    let detail = s.tree(id);
    assert_eq!(detail["tree"]["state"], "ended");
    assert!(
        !detail["authorizations"]
            .as_array()
            .expect("auths")
            .is_empty()
    );
    assert!(!detail["signals"].as_array().expect("signals").is_empty());
    let events = s.export();
    let mine: Vec<&Value> = events.iter().filter(|e| e["tree"] == id).collect();
    let auth = mine
        .iter()
        .position(|e| e["kind"] == "kill.authorized")
        .expect("kill.authorized in the export");
    let kill = mine
        .iter()
        .position(|e| e["kind"] == "signal.sent" && e["data"]["signal"] == "SIGKILL")
        .expect("a SIGKILL in the export");
    assert!(auth < kill, "kill.authorized must precede the SIGKILL");
    // The same trail as CSV, and the events API.
    let csv = s.get("/api/export?format=csv");
    assert_eq!(csv.status(), 200);
    assert!(csv.text().expect("csv").contains("kill.authorized"));
    let evs = s.get_json(&format!("/api/events?tree={id}"));
    assert!(evs.as_array().expect("events").len() >= mine.len());
    // The tree list: live by default, all with ?all=1.
    let live = s.get_json("/api/trees");
    assert!(live.as_array().expect("list").iter().all(|t| t["id"] != id));
    let all = s.get_json("/api/trees?all=1");
    assert!(all.as_array().expect("list").iter().any(|t| t["id"] == id));
}

#[test]
fn every_request_but_health_and_metrics_needs_a_token_over_tcp() {
    let s = Server::start(&[]);
    let body = s.body("sleep 1");
    for (auth, why) in [(None, "missing"), (Some("wrong-token"), "wrong")] {
        let mut req = s.http.post(s.url("/api/trees")).json(&body);
        if let Some(t) = auth {
            req = req.bearer_auth(t);
        }
        let r = req.send().expect("POST");
        assert_eq!(r.status(), 401, "{why} token");
        assert_eq!(
            r.headers()
                .get("www-authenticate")
                .and_then(|v| v.to_str().ok()),
            Some("Bearer")
        );
        let v: Value = r.json().expect("json error");
        assert!(v["error"].is_string(), "{v}");
    }
    let r = s
        .http
        .post(s.url("/api/trees/1/kill"))
        .send()
        .expect("POST");
    assert_eq!(r.status(), 401);
    assert_eq!(s.get("/api/trees").status(), 200);
    // Reads need a token too (issue 17: argv and cwd are every tenant's),
    // through the header or the dashboard's cookie; a browser is sent to
    // the login form.
    for path in [
        "/api/trees",
        "/api/events",
        "/api/export",
        "/trees/1",
        "/events",
    ] {
        assert_eq!(s.get_anon(path).status(), 401, "{path}");
    }
    let r = s
        .http
        .get(s.url("/"))
        .header("accept", "text/html")
        .send()
        .expect("GET");
    assert_eq!(r.status(), 200, "followed to the form");
    assert!(r.url().path().ends_with("/login"), "{}", r.url());
    for path in ["/healthz", "/readyz", "/metrics", "/login"] {
        assert_eq!(
            s.get_anon(path).status(),
            200,
            "{path} stays open on loopback"
        );
    }
    assert_eq!(s.get("/healthz").status(), 200);
    // The ledger, not only this instant's processes: no tree was ever made.
    let all = s.get_json("/api/trees?all=1");
    assert_eq!(
        all.as_array().map(Vec::len),
        Some(0),
        "an unauthorized spawn made a tree: {all}"
    );
    assert!(s.marked().is_empty(), "an unauthorized spawn ran");
    let mode = std::os::unix::fs::PermissionsExt::mode(
        &std::fs::metadata(s.data_dir().join("api-token"))
            .expect("token file")
            .permissions(),
    );
    assert_eq!(mode & 0o777, 0o600);
}

#[test]
fn every_bad_input_gets_its_status_and_a_json_error() {
    let s = Server::start(&[]);
    let raw = |path: &str, content_type: Option<&str>, body: Vec<u8>| {
        let mut req = s.http.post(s.url(path)).bearer_auth(&s.token).body(body);
        if let Some(ct) = content_type {
            req = req.header("content-type", ct);
        }
        // A server that answers 413 from the Content-Length alone may close
        // the connection while the 2 MiB body is still being written: the
        // client then sees a broken pipe instead of the answer. These are
        // all rejected requests, so resending is harmless: bounded retries.
        let mut tries = 0;
        let r = loop {
            tries += 1;
            let attempt = req.try_clone().expect("a body that can be cloned").send();
            match attempt {
                Ok(r) => break r,
                Err(e) if tries < 10 => eprintln!("{path}: transport error, retrying: {e}"),
                Err(e) => panic!("POST {path}: {e}"),
            }
        };
        let status = r.status().as_u16();
        let ct = r
            .headers()
            .get("content-type")
            .and_then(|v| v.to_str().ok())
            .unwrap_or("")
            .to_string();
        let v: Value = r.json().unwrap_or(Value::Null);
        (status, ct, v)
    };
    let json_ct = Some("application/json");
    let big = {
        let mut b = br#"{"argv":["true"],"label":""#.to_vec();
        b.extend(std::iter::repeat_n(b'x', 2 * 1024 * 1024));
        b.extend(br#""}"#);
        b
    };
    let cases: Vec<(&str, u16, (u16, String, Value))> = vec![
        (
            "malformed JSON",
            400,
            raw("/api/trees", json_ct, b"{\"argv\":".to_vec()),
        ),
        (
            "argv of the wrong type",
            422,
            raw("/api/trees", json_ct, br#"{"argv":"true"}"#.to_vec()),
        ),
        (
            "empty argv",
            422,
            raw("/api/trees", json_ct, br#"{"argv":[]}"#.to_vec()),
        ),
        (
            "unknown field",
            422,
            raw(
                "/api/trees",
                json_ct,
                br#"{"argv":["true"],"bogus":1}"#.to_vec(),
            ),
        ),
        (
            "bad grace",
            422,
            raw(
                "/api/trees",
                json_ct,
                br#"{"argv":["true"],"grace":"soon"}"#.to_vec(),
            ),
        ),
        (
            "bad timeout",
            422,
            raw(
                "/api/trees",
                json_ct,
                br#"{"argv":["true"],"timeout":"-1s"}"#.to_vec(),
            ),
        ),
        (
            "relative cwd",
            422,
            raw(
                "/api/trees",
                json_ct,
                br#"{"argv":["true"],"cwd":"tmp"}"#.to_vec(),
            ),
        ),
        (
            "dead owner_pid",
            422,
            raw(
                "/api/trees",
                json_ct,
                br#"{"argv":["true"],"owner_pid":2147483000}"#.to_vec(),
            ),
        ),
        (
            "command not found",
            422,
            raw(
                "/api/trees",
                json_ct,
                br#"{"argv":["/nonexistent/tw-no-such-command"]}"#.to_vec(),
            ),
        ),
        (
            "no content type",
            415,
            raw("/api/trees", None, br#"{"argv":["true"]}"#.to_vec()),
        ),
        ("body over 1 MiB", 413, raw("/api/trees", json_ct, big)),
        (
            "unknown tree kill",
            404,
            raw("/api/trees/987654/kill", None, Vec::new()),
        ),
        (
            "malformed tree id",
            400,
            raw("/api/trees/abc/kill", None, Vec::new()),
        ),
        (
            "bad kill grace (422, as in a spawn's body)",
            422,
            raw("/api/trees/1/kill?grace=later", None, Vec::new()),
        ),
        (
            "resolve unknown tree",
            404,
            raw(
                "/api/trees/987654/resolve",
                json_ct,
                br#"{"note":"x"}"#.to_vec(),
            ),
        ),
        (
            "resolve with empty note",
            422,
            raw("/api/trees/1/resolve", json_ct, br#"{"note":" "}"#.to_vec()),
        ),
    ];
    for (what, want, (status, ct, v)) in cases {
        assert_eq!(status, want, "{what}: {v}");
        assert!(
            ct.starts_with("application/json"),
            "{what}: content-type {ct}"
        );
        assert!(
            v["error"].as_str().is_some_and(|e| !e.is_empty()),
            "{what}: {v}"
        );
    }
    let get = |path: &str| {
        let r = s.get(path);
        let status = r.status().as_u16();
        (status, r.json::<Value>().unwrap_or(Value::Null))
    };
    for (path, want) in [
        ("/api/trees/987654", 404),
        ("/api/trees/abc", 400),
        ("/api/trees?all=maybe", 400),
        ("/api/export?format=xml", 400),
        ("/api/events?since=yesterday-ish", 400),
        ("/api/events?tree=abc", 400),
        // Unknown parameters and empty windows are refused, not ignored.
        ("/api/events?kind=", 400),
        ("/api/trees?alll=1", 400),
        ("/api/export?after=1&bogus=", 400),
        ("/api/events?since=0", 400),
        ("/api/no-such-endpoint", 404),
    ] {
        let (status, v) = get(path);
        assert_eq!(status, want, "{path}: {v}");
        assert!(v["error"].is_string(), "{path}: {v}");
    }
    // A time before the epoch selects everything (and never takes the
    // ledger down: it once panicked the ledger thread).
    let (status, v) = get("/api/events?since=1960-01-01T00:00:00Z");
    assert_eq!(status, 200, "{v}");
    assert_eq!(get("/healthz").0, 200);
    // A spawn answers 201 with the new tree's Location.
    let r = s
        .http
        .post(s.url("/api/trees"))
        .bearer_auth(&s.token)
        .json(&s.body("exit 0"))
        .send()
        .expect("POST");
    assert_eq!(r.status(), 201);
    let location = r
        .headers()
        .get("location")
        .and_then(|v| v.to_str().ok())
        .map(String::from)
        .unwrap_or_default();
    let created: Value = r.json().expect("json");
    assert_eq!(location, format!("/api/trees/{}", created["id"]));
    assert_eq!(s.get(&location).status(), 200);
    // A tree that is not ambiguous cannot be resolved: 409.
    let id = s.spawn(&s.body("exit 0"));
    let (status, v) = s.post(
        &format!("/api/trees/{id}/resolve"),
        Some(&json!({"note": "x"})),
    );
    assert_eq!(status, 409, "{v}");
    assert!(
        wait_until(Duration::from_secs(10), || s.tree(id)["tree"]["state"]
            == "ended"),
        "the `exit 0` tree did not end: {}",
        s.tree(id)
    );
    assert!(
        wait_until(Duration::from_secs(10), || s.marked().is_empty()),
        "survivors: {:?}",
        s.marked()
    );
}

#[test]
fn owner_death_tears_the_tree_down_within_a_second() {
    let s = Server::start(&[]);
    // Killed by pid on drop, should an assertion fail before its kill below.
    let mut client = KillOnDrop(
        Command::new("sleep")
            .arg("300")
            .stdin(Stdio::null())
            .spawn()
            .expect("client process"),
    );
    let mut body = s.body("sleep 300 & sleep 300 & wait");
    body["owner_pid"] = json!(client.id());
    let id = s.spawn(&body);
    assert!(
        wait_until(Duration::from_secs(20), || s.marked().len() >= 3),
        "tree did not start"
    );
    assert_eq!(s.tree(id)["tree"]["owner"]["kind"], "client");
    let killed = Instant::now();
    let _ = client.0.kill();
    let _ = client.0.wait();
    let gone = wait_until(Duration::from_secs(5), || s.marked().is_empty());
    let took = killed.elapsed();
    assert!(gone, "survivors after owner death: {:?}", s.marked());
    assert!(
        took <= Duration::from_secs(1),
        "tree outlived its owner by {took:?}"
    );
    assert!(wait_until(Duration::from_secs(5), || {
        s.tree(id)["tree"]["state"] == "ended"
    }));
    let reasons: Vec<String> = s.tree(id)["events"]
        .as_array()
        .expect("events")
        .iter()
        .filter(|e| e["kind"] == "tree.state")
        .map(|e| e["data"]["reason"].to_string())
        .collect();
    assert!(
        reasons.iter().any(|r| r.contains("owner exited")),
        "{reasons:?}"
    );
}

#[test]
fn sigterm_to_serve_tears_down_its_trees_and_exits_0() {
    let mut s = Server::start(&[]);
    let a = s.spawn(&s.body("sleep 300 & sleep 300 & wait"));
    let b = s.spawn(&s.body(STUBBORN));
    assert!(
        wait_until(Duration::from_secs(20), || s.marked().len() >= 6),
        "trees did not start: {:?}",
        s.marked()
    );
    let status = s.terminate().expect("serve exits");
    assert_eq!(status.code(), Some(0), "serve log: {}", s.stderr());
    assert!(
        wait_until(Duration::from_secs(5), || s.marked().is_empty()),
        "survivors: {:?}",
        s.marked()
    );
    // The ledger says so too (read with the CLI: the server is gone).
    let out = Command::new(bin())
        .env("TREEWARDEN_DATA_DIR", s.data_dir())
        .args(["ls", "--all", "--json"])
        .output()
        .expect("ls");
    let trees: Value = serde_json::from_slice(&out.stdout).expect("ls json");
    for id in [a, b] {
        let t = trees
            .as_array()
            .expect("list")
            .iter()
            .find(|t| t["id"] == id)
            .expect("tree listed");
        assert_eq!(t["state"], "ended", "{t}");
    }
}

#[test]
fn metrics_pass_promtool_and_never_label_by_tree_or_pid() {
    let s = Server::start(&[]);
    spawn_and_kill(&s);
    let live = s.spawn(&s.body("sleep 300"));
    assert!(wait_until(Duration::from_secs(10), || {
        s.tree(live)["members"].as_array().map_or(0, |m| m.len()) >= 1
    }));
    // The scan loop tails the ledger into the counters; wait for it, up to
    // the SIGKILL's own record (committed after the authorization's: a
    // scrape between the two saw the one without the other).
    let mut text = String::new();
    assert!(
        wait_until(Duration::from_secs(10), || {
            text = s.get("/metrics").text().expect("metrics");
            text.contains("treewarden_kill_authorizations_written_total 1")
                && text.contains("treewarden_signals_sent_total{signal=\"SIGKILL\"")
        }),
        "{text}"
    );
    std::fs::write(artifacts().join("metrics.txt"), &text).expect("artifact");
    for name in [
        "treewarden_trees{state=\"running\"} 1",
        "treewarden_members ",
        "treewarden_escapes_observed_total",
        "treewarden_signals_sent_total{signal=\"SIGKILL\"",
        "treewarden_kill_authorizations_failed_total 0",
        "treewarden_kills_skipped_total",
        "treewarden_survivors_after_kill_total",
        "treewarden_sweeps_total",
        "treewarden_sweep_orphans_total",
        "treewarden_scan_duration_seconds_bucket",
        "treewarden_teardown_duration_seconds_bucket",
        "treewarden_ledger_write_errors_total 0",
        "treewarden_dispatch_closed 0",
        "treewarden_ledger_head_seq ",
    ] {
        assert!(text.contains(name), "missing {name} in\n{text}");
    }
    for bad in ["tree=", "pid=", "id="] {
        assert!(!text.contains(bad), "unbounded label {bad} in\n{text}");
    }
    let om = s
        .http
        .get(s.url("/metrics"))
        .header("accept", "application/openmetrics-text; version=1.0.0")
        .send()
        .expect("metrics")
        .text()
        .expect("body");
    assert!(om.trim_end().ends_with("# EOF"));
    let Some(promtool) = tool("promtool") else {
        skip("promtool not installed (Debian package prometheus)");
        return;
    };
    // Input and output through files, so the wait is bounded.
    let metrics_in = s.dir.path().join("promtool.in");
    let (out_path, err_path) = (
        s.dir.path().join("promtool.stdout"),
        s.dir.path().join("promtool.stderr"),
    );
    std::fs::write(&metrics_in, &text).expect("promtool input");
    let mut check = Command::new(promtool)
        .args(["check", "metrics"])
        .stdin(std::fs::File::open(&metrics_in).expect("promtool input"))
        .stdout(std::fs::File::create(&out_path).expect("promtool stdout"))
        .stderr(std::fs::File::create(&err_path).expect("promtool stderr"))
        .spawn()
        .expect("promtool");
    let status = wait_child(&mut check, Duration::from_secs(60));
    assert!(
        status.is_some_and(|s| s.success()),
        "promtool check metrics ({status:?}): {}{}",
        std::fs::read_to_string(&out_path).unwrap_or_default(),
        std::fs::read_to_string(&err_path).unwrap_or_default()
    );
}

fn chromium(user_dir: &Path, extra: &[&str], url: &str) -> std::process::Output {
    let mut child = Command::new("/usr/bin/chromium")
        .args([
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-quic",
            "--no-first-run",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--disable-dev-shm-usage",
            "--hide-scrollbars",
        ])
        .arg(format!("--user-data-dir={}", user_dir.display()))
        .args(extra)
        .arg(url)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("chromium");
    let mut stdout = child.stdout.take().expect("stdout");
    let reader = std::thread::spawn(move || {
        let mut s = Vec::new();
        let _ = stdout.read_to_end(&mut s);
        s
    });
    let status = wait_child(&mut child, Duration::from_secs(90));
    let out = reader.join().unwrap_or_default();
    let mut err = Vec::new();
    if let Some(mut e) = child.stderr.take() {
        let _ = e.read_to_end(&mut err);
    }
    std::process::Output {
        status: status.unwrap_or_else(|| std::os::unix::process::ExitStatusExt::from_raw(9)),
        stdout: out,
        stderr: err,
    }
}

#[test]
fn dashboard_renders_trees_and_the_teardown_timeline_in_headless_chromium() {
    // `chromium --dump-dom` sends no header and submits no form: this
    // server runs single-tenant (--open-reads), the one mode in which a
    // tokenless browser reads. The login form is driven by Chromium over
    // the DevTools protocol in `session.rs`
    // (`a_browser_logged_in_here_gives_another_loopback_port_nothing_that_writes`).
    let s = Server::start(&["--open-reads"]);
    let killed = spawn_and_kill(&s);
    let live = s.spawn(&s.body("sleep 300"));
    assert!(wait_until(Duration::from_secs(10), || {
        s.tree(live)["members"].as_array().map_or(0, |m| m.len()) >= 1
    }));
    // Server-rendered: the pages are complete without a browser.
    let index = s.get("/").text().expect("index");
    assert!(
        index.contains(&format!("href=\"/trees/{live}\"")),
        "{index}"
    );
    assert!(index.contains("dispatch open"));
    // What the service owns is its live trees (the killed one is no longer).
    assert!(
        index.contains("this service owns 1 live tree now"),
        "{index}"
    );
    // The live tree's owner is this service, which runs; what its cgroup
    // (where there is one) has used is shown beside it.
    let row = &index[index.find(&format!("href=\"/trees/{live}\"")).expect("row")..];
    let row = &row[..row.find("</tr>").expect("row end")];
    let serve_pid = s.child.as_ref().expect("serve").id();
    assert!(
        row.contains(&format!(
            "service {serve_pid} <span class=\"muted\">(alive)</span>"
        )),
        "{row}"
    );
    // An ended tree's members column counts every member it had (as its
    // record lists them), not the none left alive.
    let had = s.tree(killed)["members"].as_array().map_or(0, |m| m.len());
    assert!(had >= 3, "sh and its two sleeps: {had}");
    let all = s.get("/?all=1").text().expect("index");
    let row = &all[all.find(&format!("href=\"/trees/{killed}\"")).expect("row")..];
    let row = &row[..row.find("</tr>").expect("row end")];
    let cell = row
        .split("<td>")
        .nth(7)
        .and_then(|c| c.split("</td>").next());
    assert_eq!(cell, Some(had.to_string().as_str()), "{row}");
    let page = s
        .get(&format!("/trees/{killed}"))
        .text()
        .expect("tree page");
    assert!(page.contains("<svg") && page.contains("KILL"), "{page}");
    let events = s.get("/events?kind=kill.").text().expect("events page");
    assert!(events.contains("kill.authorized"));
    if !Path::new("/usr/bin/chromium").exists() {
        skip("chromium not installed (Debian package chromium)");
        return;
    }
    let profile = tempfile::tempdir().expect("profile dir");
    let dom = chromium(
        profile.path(),
        &["--dump-dom"],
        &s.url(&format!("/trees/{killed}")),
    );
    let dom = String::from_utf8_lossy(&dom.stdout).to_string();
    assert!(dom.contains("id=\"timeline\""), "no timeline in DOM: {dom}");
    assert!(
        dom.contains("authorized") && dom.contains("verified"),
        "{dom}"
    );
    assert!(dom.contains("kill authorized #"), "{dom}");
    let dom = chromium(profile.path(), &["--dump-dom"], &s.url("/"));
    let dom = String::from_utf8_lossy(&dom.stdout).to_string();
    assert!(dom.contains("id=\"trees\""), "{dom}");
    for (name, path) in [
        ("dashboard.png", "/?all=1".to_string()),
        ("tree.png", format!("/trees/{killed}")),
    ] {
        let shot = artifacts().join(name);
        let _ = std::fs::remove_file(&shot);
        let out = chromium(
            profile.path(),
            &[
                &format!("--screenshot={}", shot.display()),
                "--window-size=1280,900",
            ],
            &s.url(&path),
        );
        assert!(
            shot.is_file() && std::fs::metadata(&shot).map(|m| m.len()).unwrap_or(0) > 1000,
            "no screenshot {}: {}",
            shot.display(),
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

/// A tiny OTLP/HTTP receiver: accepts requests on 127.0.0.1, answers 200,
/// keeps the bodies.
/// Requests the stub received: (path, body).
type Received = Arc<Mutex<Vec<(String, Vec<u8>)>>>;

fn otlp_stub() -> (String, Received) {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind stub");
    let addr = listener.local_addr().expect("addr").to_string();
    let got: Received = Arc::default();
    let store = got.clone();
    std::thread::spawn(move || {
        for stream in listener.incoming().flatten() {
            let store = store.clone();
            std::thread::spawn(move || {
                let _ = stream.set_read_timeout(Some(Duration::from_secs(10)));
                let mut reader = BufReader::new(stream.try_clone().expect("clone"));
                loop {
                    let Some((path, body)) = crate::util::read_http_request(&mut reader) else {
                        return;
                    };
                    store.lock().expect("lock").push((path, body));
                    let mut w = &stream;
                    let _ = w.write_all(
                        b"HTTP/1.1 200 OK\r\ncontent-type: application/x-protobuf\r\ncontent-length: 0\r\n\r\n",
                    );
                }
            });
        }
    });
    (addr, got)
}

#[test]
fn an_otlp_receiver_gets_the_teardown_span() {
    let (addr, got) = otlp_stub();
    let endpoint = format!("http://{addr}");
    let mut s = Server::start_with_env(&[], &[("OTEL_EXPORTER_OTLP_ENDPOINT", &endpoint)]);
    spawn_and_kill(&s);
    // Shutdown flushes the batch exporter.
    let status = s.terminate().expect("serve exits");
    assert_eq!(status.code(), Some(0), "{}", s.stderr());
    let has = |needle: &[u8]| {
        got.lock().expect("lock").iter().any(|(path, body)| {
            path == "/v1/traces" && body.windows(needle.len()).any(|w| w == needle)
        })
    };
    assert!(
        wait_until(Duration::from_secs(10), || has(b"teardown")),
        "no teardown span received; requests: {:?}; log: {}",
        got.lock()
            .expect("lock")
            .iter()
            .map(|(p, b)| (p.clone(), b.len()))
            .collect::<Vec<_>>(),
        s.stderr()
    );
    assert!(has(b"teardown.phase"), "no phase spans");
    assert!(has(b"treewarden"), "no service name");
}

#[test]
fn schemathesis_finds_no_failure_of_any_check_and_leaves_no_tree_running() {
    let Some(st) = tool("schemathesis") else {
        skip("schemathesis not installed (pip install schemathesis)");
        return;
    };
    // Spawns go through a hook that replaces argv with a harmless, marked
    // command, and the allow-list refuses anything else.
    let harmless = "/bin/sleep";
    let mut s = Server::start(&[
        "--allow-command",
        harmless,
        "--allow-env",
        "TW_TEST_MARK",
        "--grace",
        "100ms",
    ]);
    let hooks_dir = s.dir.path().join("hooks");
    std::fs::create_dir_all(&hooks_dir).expect("hooks dir");
    std::fs::write(
        hooks_dir.join("tw_hooks.py"),
        format!(
            r#"import os
import schemathesis

@schemathesis.hook
def before_call(context, case, kwargs):
    if case.method.upper() == "POST" and case.path == "/api/trees" and isinstance(case.body, dict):
        case.body["argv"] = ["{harmless}", "2"]
        case.body["env"] = {{"TW_TEST_MARK": "{mark}"}}
        # What the schema cannot say (a live process, an existing
        # directory) is made true where the case is otherwise schema-valid.
        pid = case.body.get("owner_pid")
        if isinstance(pid, (int, float)) and not isinstance(pid, bool) and pid == int(pid) and pid >= 2:
            case.body["owner_pid"] = os.getpid()
            case.body.pop("owner_start_ticks", None)
        if isinstance(case.body.get("cwd"), str):
            case.body["cwd"] = "/"
        # A schema-valid user name need not exist here: the one that does.
        if isinstance(case.body.get("user"), str):
            case.body["user"] = "root"
        # Whether a limit can be enforced depends on the host (its cgroup
        # v2 controllers): schema-valid limits are dropped, invalid ones kept.
        lim = case.body.get("limits")
        if isinstance(lim, dict) and set(lim) <= {{"memory_max", "pids_max", "cpu_max"}}:
            import re
            mem, pids, cpu = lim.get("memory_max"), lim.get("pids_max"), lim.get("cpu_max")
            ok = (mem is None or (isinstance(mem, str) and re.search(r"^[1-9][0-9]{{0,5}}[KMGT]?$", mem))) \
                and (pids is None or (isinstance(pids, int) and not isinstance(pids, bool) and 1 <= pids <= 1000000)) \
                and (cpu is None or (isinstance(cpu, str) and re.search(r"^[1-9][0-9]{{0,4}}%?$", cpu)))
            if ok:
                case.body.pop("limits")
"#,
            mark = s.mark
        ),
    )
    .expect("hooks");
    let out = Command::new(st)
        .current_dir(s.dir.path())
        .env("SCHEMATHESIS_HOOKS", "tw_hooks")
        .env("PYTHONPATH", &hooks_dir)
        .env("NO_COLOR", "1")
        .args([
            "run",
            &s.url("/api/openapi.json"),
            "--header",
            &format!("Authorization: Bearer {}", s.token),
            // Every check: no 5xx, and no contract mismatch either way
            // (schema-valid requests accepted, schema-violating refused).
            "--checks",
            "all",
            "--max-examples",
            "15",
            "--phases",
            "examples,coverage,fuzzing",
            "--request-timeout",
            "30",
            "--workers",
            "1",
            // One fixed seed: CI reruns the same cases (a failure is
            // reproducible with `st replay`), not new ones each time.
            "--seed",
            "20261130",
            // The live stream never ends by itself; it has a test of its own.
            "--exclude-path",
            "/api/events/stream",
            // Nor is the drain one (it ends the service under test).
            "--exclude-path",
            "/api/shutdown",
        ])
        .stdin(Stdio::null())
        .output()
        .expect("schemathesis");
    let report = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let _ = std::fs::write(artifacts().join("schemathesis.txt"), &report);
    assert!(out.status.success(), "schemathesis failed:\n{report}");
    let status = s.terminate().expect("serve exits");
    assert_eq!(status.code(), Some(0), "{}", s.stderr());
    assert!(
        wait_until(Duration::from_secs(5), || s.marked().is_empty()),
        "trees left running: {:?}",
        s.marked()
    );
    let out = Command::new(bin())
        .env("TREEWARDEN_DATA_DIR", s.data_dir())
        .args(["ls", "--json"])
        .output()
        .expect("ls");
    let live: Value = serde_json::from_slice(&out.stdout).expect("ls json");
    assert_eq!(
        live.as_array().map(|a| a.len()),
        Some(0),
        "live trees: {live}"
    );
}

#[test]
fn serve_runs_the_observer_and_records_an_escape_before_any_scan() {
    // Scans are made (nearly) blind: one at start, then an hour apart. On
    // the session boundary only the observer can see the setsid escape.
    let s = Server::start_with_env(
        &["--scan-interval", "1h", "--full-scan-interval", "1h"],
        &[("TREEWARDEN_BOUNDARY", "session")],
    );
    let metrics = s.get("/metrics").text().expect("metrics");
    if metrics.contains("treewarden_observer_up 0") {
        crate::util::skip("the proc connector is unavailable here: the service runs on scans only");
        assert!(s.get("/").text().expect("page").contains("observer off"));
        return;
    }
    assert!(metrics.contains("treewarden_observer_up 1"), "{metrics}");
    let id = s.spawn(&s.body(
        "while [ ! -e go ]; do sleep 0.01; done; (setsid sh -c 'exec sleep 600' &); exec sleep 600",
    ));
    // The root is recorded before the escape is let go (as in the observer
    // tests), so the escape is one from a known member.
    assert!(
        wait_until(Duration::from_secs(20), || {
            s.tree(id)["members"]
                .as_array()
                .is_some_and(|m| !m.is_empty())
        }),
        "the root was never recorded: {}; log: {}",
        s.tree(id),
        s.stderr()
    );
    std::fs::write(s.dir.path().join("go"), b"").expect("go file");
    assert!(
        wait_until(Duration::from_secs(10), || {
            s.export()
                .iter()
                .any(|e| e["tree"] == id && e["kind"] == "escape.observed")
        }),
        "the escape was recorded by the observer; log: {}",
        s.stderr()
    );
    let (status, r) = s.post(&format!("/api/trees/{id}/kill?grace=100ms"), None);
    assert_eq!(status, 200, "kill answered {r}");
    assert!(
        wait_until(Duration::from_secs(10), || s.marked().is_empty()),
        "the observed escapee survived: {:?}",
        s.marked()
    );
    assert!(
        wait_until(Duration::from_secs(10), || {
            let m = s.get("/metrics").text().unwrap_or_default();
            m.lines()
                .any(|l| l.starts_with("treewarden_observer_escapes_total") && !l.ends_with(" 0"))
        }),
        "the observer's escape is counted"
    );
    let page = s.get("/").text().expect("page");
    assert!(page.contains("observer on"), "{page}");
}

/// While the observer follows every tree the scan loop does not list
/// `/proc`. A member it never saw forked (here a process moved into the
/// tree's cgroup, with a child it forked before) makes the next tick list
/// `/proc`, which finds that child by descent, long before the full
/// re-read (an hour away here).
#[test]
fn a_member_the_observer_missed_makes_the_next_scan_list_proc() {
    let s = Server::start(&["--full-scan-interval", "1h"]);
    let metrics = s.get("/metrics").text().expect("metrics");
    if !metrics.contains("treewarden_observer_up 1") {
        skip("the proc connector is unavailable here: every scan lists /proc");
        return;
    }
    if s.cgroup_root.is_none() {
        skip("needs the cgroup boundary (root and cgroup v2) to move a process into a tree");
        return;
    }
    // A tree that forks every half second: each fork moves its observer
    // generation, so targeted ticks read it (and its `cgroup.procs`) again.
    let id = s.spawn(&s.body("while :; do sleep 0.5; done"));
    let cgroup = wait_until(Duration::from_secs(20), || {
        s.tree(id)["tree"]["cgroup"].is_string()
            && s.tree(id)["members"]
                .as_array()
                .is_some_and(|m| !m.is_empty())
    });
    assert!(
        cgroup,
        "the tree has no cgroup or no member: {}",
        s.tree(id)
    );
    let dir = PathBuf::from(s.tree(id)["tree"]["cgroup"].as_str().unwrap_or_default());
    // The outsider forks its child first, then is moved into the tree.
    let mut outsider = KillOnDrop(
        Command::new("sh")
            .args(["-c", "sleep 600 & echo $!; wait"])
            .env("TW_TEST_MARK", &s.mark)
            .stdout(Stdio::piped())
            .spawn()
            .expect("spawn the outsider"),
    );
    let mut line = String::new();
    {
        use std::io::BufRead as _;
        let out = outsider.0.stdout.take().expect("piped stdout");
        BufReader::new(out)
            .read_line(&mut line)
            .expect("the child's pid");
    }
    let child: i32 = line.trim().parse().expect("a pid");
    let members = |s: &Server| -> Vec<i64> {
        s.tree(id)["members"]
            .as_array()
            .map(|m| m.iter().filter_map(|m| m["pid"].as_i64()).collect())
            .unwrap_or_default()
    };
    // Ticks (100 ms) that do not list /proc have run by now and have not
    // seen the child: nothing links it to the tree yet.
    assert!(!members(&s).contains(&i64::from(child)));
    std::fs::write(dir.join("cgroup.procs"), outsider.id().to_string())
        .expect("move into the tree");
    // The next targeted tick of the tree (after its next fork) reads its
    // `cgroup.procs`: the moved process is a member the observer did not
    // attribute, so the tick after lists `/proc` and finds its child by
    // descent, long before the hour's full scan.
    let found = wait_until(Duration::from_secs(20), || {
        let m = members(&s);
        m.contains(&i64::from(outsider.id())) && m.contains(&i64::from(child))
    });
    signal(child as u32, rustix::process::Signal::KILL);
    assert!(
        found,
        "the moved process and its child were not both found: {:?} (child {child}); log: {}",
        members(&s),
        s.stderr()
    );
    let (status, r) = s.post(&format!("/api/trees/{id}/kill?grace=100ms"), None);
    assert_eq!(status, 200, "kill answered {r}");
    drop(outsider);
    assert!(
        wait_until(Duration::from_secs(10), || s.marked().is_empty()),
        "left running: {:?}",
        s.marked()
    );
}

/// `POST /api/shutdown` on Linux: the admin's request is recorded (who,
/// and the trees owned then) before the drain, which ends the service's
/// tree and exits 0; the ledger verifies afterwards.
#[test]
fn an_admins_shutdown_over_http_is_recorded_then_drains_every_tree() {
    let mut s = Server::start(&[]);
    let id = s.spawn(&s.body("sleep 600 & exec sleep 600"));
    assert!(
        wait_until(Duration::from_secs(20), || s.marked().len() == 2),
        "the tree's two processes: {:?}",
        s.marked()
    );
    let (status, v) = s.post("/api/shutdown", None);
    assert_eq!((status, &v["draining"]), (202, &json!(true)), "{v}");
    let mut child = s.child.take().expect("serve runs");
    let status = wait_child(&mut child, Duration::from_secs(40)).expect("serve exits");
    assert_eq!(status.code(), Some(0), "{}", s.stderr());
    assert!(
        wait_until(Duration::from_secs(10), || s.marked().is_empty()),
        "left running after the drain: {:?}",
        s.marked()
    );
    let export = Command::new(bin())
        .env("TREEWARDEN_DATA_DIR", s.data_dir())
        .args(["export", "--format", "ndjson"])
        .output()
        .expect("export");
    assert!(
        export.status.success(),
        "{}",
        String::from_utf8_lossy(&export.stderr)
    );
    let events = crate::util::parse_ndjson(&String::from_utf8_lossy(&export.stdout));
    let asked: Vec<&Value> = events
        .iter()
        .filter(|e| e["kind"] == "service.shutdown_requested")
        .collect();
    assert_eq!(asked.len(), 1, "{asked:?}");
    assert_eq!(asked[0]["tree"], Value::Null);
    assert_eq!(asked[0]["data"]["by"]["via"], "tcp", "{}", asked[0]);
    assert!(asked[0]["data"]["by"]["token_id"].is_i64(), "{}", asked[0]);
    assert_eq!(asked[0]["data"]["owned_trees"], 1, "{}", asked[0]);
    // Written before the drain's teardown of the tree began.
    let ended = events
        .iter()
        .position(|e| e["tree"] == id && e["kind"] == "tree.ended")
        .expect("the tree ended");
    let at = events
        .iter()
        .position(|e| e["kind"] == "service.shutdown_requested")
        .expect("recorded");
    assert!(at < ended, "the request after the tree's end");
    let verify = Command::new(bin())
        .env("TREEWARDEN_DATA_DIR", s.data_dir())
        .arg("verify")
        .output()
        .expect("verify");
    assert!(
        verify.status.success(),
        "{}",
        String::from_utf8_lossy(&verify.stdout)
    );
}

/// The full scan bumps `last_seen` of every watched tree's live members
/// (in one ledger write for all the trees), quiet trees included.
#[test]
fn the_full_scan_bumps_last_seen_of_a_quiet_trees_members() {
    let s = Server::start(&["--full-scan-interval", "1s"]);
    let id = s.spawn(&s.body("exec sleep 600"));
    let last_seen = |s: &Server| -> Option<String> {
        s.tree(id)["members"]
            .as_array()
            .and_then(|m| m.first())
            .and_then(|m| m["last_seen"].as_str().map(str::to_owned))
    };
    let mut first = None;
    assert!(
        wait_until(Duration::from_secs(20), || {
            first = last_seen(&s);
            first.is_some()
        }),
        "the root was never recorded: {}",
        s.tree(id)
    );
    assert!(
        wait_until(Duration::from_secs(20), || last_seen(&s) > first),
        "last_seen stayed {first:?}; log: {}",
        s.stderr()
    );
    let (status, r) = s.post(&format!("/api/trees/{id}/kill?grace=100ms"), None);
    assert_eq!(status, 200, "kill answered {r}");
    assert!(
        wait_until(Duration::from_secs(10), || s.marked().is_empty()),
        "left running: {:?}",
        s.marked()
    );
}

/// The value of an unlabelled counter in `/metrics` (0 if absent).
fn counter(s: &Server, name: &str) -> u64 {
    let text = s.get("/metrics").text().unwrap_or_default();
    text.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.trim().parse().ok())
        .unwrap_or(0)
}

/// Issue 30: an idle tree the observer follows is not re-read at every
/// targeted tick (it is "quiet": the observer saw no change of its
/// members), yet a member's exit still reaches the ledger at the next
/// tick — the exit moves the tree's generation. The session boundary has
/// no cgroup to re-check, and the full scan is an hour away: only the
/// generation can make the tick look again.
#[test]
fn a_quiet_tree_is_skipped_by_the_scan_until_a_member_exits() {
    let s = Server::start_with_env(
        &["--full-scan-interval", "1h"],
        &[("TREEWARDEN_BOUNDARY", "session")],
    );
    if !s
        .get("/metrics")
        .text()
        .unwrap_or_default()
        .contains("treewarden_observer_up 1")
    {
        skip("the proc connector is unavailable here: every tick re-reads every tree");
        return;
    }
    let id = s.spawn(&s.body("sleep 600 & echo $! > child.pid; exec sleep 600"));
    let pid_file = s.dir.path().join("child.pid");
    let child: Option<i64> = {
        let mut child = None;
        wait_until(Duration::from_secs(20), || {
            child = std::fs::read_to_string(&pid_file)
                .ok()
                .and_then(|t| t.trim().parse().ok());
            child.is_some()
        });
        child
    };
    let child = child.expect("the workload printed its child's pid");
    let members = |s: &Server| -> Vec<i64> {
        s.tree(id)["members"]
            .as_array()
            .map(|m| m.iter().filter_map(|m| m["pid"].as_i64()).collect())
            .unwrap_or_default()
    };
    assert!(
        wait_until(Duration::from_secs(20), || members(&s).contains(&child)),
        "the child {child} was never recorded: {:?}; log: {}",
        members(&s),
        s.stderr()
    );
    // Quiet: the ticks (every 100 ms) skip it, again and again.
    let skipped = "treewarden_scan_trees_skipped_total";
    assert!(
        wait_until(Duration::from_secs(20), || counter(&s, skipped) > 0),
        "no tick skipped the idle tree; log: {}",
        s.stderr()
    );
    let before = counter(&s, skipped);
    assert!(
        wait_until(Duration::from_secs(20), || counter(&s, skipped)
            >= before + 5),
        "the idle tree was skipped once, then ticked again"
    );
    let exited = |s: &Server| {
        s.export().iter().any(|e| {
            e["tree"] == id
                && e["kind"] == "member.exited"
                && e["data"]["identity"]["pid"].as_i64() == Some(child)
        })
    };
    assert!(!exited(&s), "the child's exit recorded while it lives");
    signal(child as u32, rustix::process::Signal::KILL);
    assert!(
        wait_until(Duration::from_secs(20), || exited(&s)),
        "the exit of {child} in a quiet tree was never recorded; log: {}",
        s.stderr()
    );
    // And quiet again afterwards.
    let after = counter(&s, skipped);
    assert!(
        wait_until(Duration::from_secs(20), || counter(&s, skipped) > after),
        "the tree was never quiet again after the exit"
    );
    let (status, r) = s.post(&format!("/api/trees/{id}/kill?grace=100ms"), None);
    assert_eq!(status, 200, "kill answered {r}");
    assert!(
        wait_until(Duration::from_secs(10), || s.marked().is_empty()),
        "left running: {:?}",
        s.marked()
    );
}

#[test]
fn foreign_host_names_need_the_token_and_the_allowlist_cannot_be_bypassed() {
    let s = Server::start(&["--allow-command", "sh"]);
    // DNS rebinding: a page that points its own name at 127.0.0.1 sends its
    // own name as Host; without the token it reads nothing.
    let r = s
        .http
        .get(s.url("/api/export?format=csv"))
        .header("host", "attacker.example")
        .send()
        .expect("GET");
    assert_eq!(r.status(), 401);
    let r = s
        .http
        .get(s.url("/api/trees"))
        .header("host", "attacker.example")
        .bearer_auth(&s.token)
        .send()
        .expect("GET");
    assert_eq!(r.status(), 200);
    assert_eq!(
        s.get_anon("/api/trees").status(),
        401,
        "loopback names read only with a token (no --open-reads)"
    );
    // With an allowlist, the request may not choose how argv[0] is found.
    for env in [json!({"PATH": "/tmp"}), json!({"LD_PRELOAD": "/tmp/x.so"})] {
        let (status, v) = s.post(
            "/api/trees",
            Some(&json!({"argv": ["sh", "-c", "true"], "env": env})),
        );
        assert_eq!(status, 422, "{v}");
    }
    // A kernel thread never exits: it cannot own a tree.
    let (status, v) = s.post(
        "/api/trees",
        Some(&json!({"argv": ["sh", "-c", "true"], "owner_pid": 2})),
    );
    assert_eq!(status, 422, "{v}");
}

/// Where each `<li data-pid=N>` of the tree page's process tree sits: its
/// pid and how many lists deep (the top list is 1), in document order.
fn ptree_depths(html: &str) -> Vec<(i64, usize)> {
    let start = html
        .find("id=\"ptree\"")
        .expect("a process tree on the page");
    let start = html[..start].rfind('<').expect("its tag");
    let mut depth = 0usize;
    let mut out = Vec::new();
    for tag in html[start..].split('<').skip(1) {
        if tag.starts_with("ul") {
            depth += 1;
        } else if tag.starts_with("/ul") {
            depth -= 1;
            if depth == 0 {
                break;
            }
        } else if let Some(rest) = tag.strip_prefix("li data-pid=\"") {
            let pid = rest.split('"').next().and_then(|p| p.parse().ok());
            out.push((pid.expect("a pid"), depth));
        }
    }
    out
}

/// The tree page draws the members as the process tree the workload itself
/// printed (root -> child -> grandchild, by their pids and ppids), as nested
/// lists rendered by the server, and marks the forced kills; the same in
/// headless Chromium's DOM.
#[test]
fn the_tree_page_nests_the_members_as_the_workload_printed_them() {
    let s = Server::start(&["--open-reads"]);
    // Every process ignores SIGTERM (inherited), so the kill forces them all.
    let id = s.spawn(&s.body(
        "trap '' TERM; echo \"root $$ $PPID\"; \
         sh -c 'echo \"child $$ $PPID\"; sleep 300 & echo \"grandchild $! $$\"; wait' & wait",
    ));
    let lineage = || -> std::collections::HashMap<String, (i64, i64)> {
        let log = s
            .get(&format!("/api/trees/{id}/log"))
            .text()
            .unwrap_or_default();
        log.lines()
            .filter_map(|l| {
                let mut w = l.split_whitespace();
                let name = w.next()?.to_string();
                Some((name, (w.next()?.parse().ok()?, w.next()?.parse().ok()?)))
            })
            .collect()
    };
    assert!(
        wait_until(Duration::from_secs(20), || lineage().len() == 3
            && s.tree(id)["members"].as_array().map_or(0, |m| m.len()) >= 3),
        "the workload's lines: {:?}; tree {}",
        lineage(),
        s.tree(id)
    );
    let t = lineage();
    let (status, r) = s.post(&format!("/api/trees/{id}/kill?grace=100ms"), None);
    assert_eq!(status, 200, "kill answered {r}");
    assert_eq!(r["state"], "ended", "{r}");
    let (root, child, grandchild) = (t["root"].0, t["child"].0, t["grandchild"].0);
    assert_eq!(t["child"].1, root);
    assert_eq!(t["grandchild"].1, child);
    let check = |html: &str, what: &str| {
        let depths = ptree_depths(html);
        let at = |pid: i64| {
            depths
                .iter()
                .position(|(p, _)| *p == pid)
                .unwrap_or_else(|| panic!("[{what}] {pid} not in the tree: {depths:?}"))
        };
        let (r, c, g) = (at(root), at(child), at(grandchild));
        assert_eq!(depths[r].1, 1, "[{what}] {depths:?}");
        assert_eq!(depths[c].1, 2, "[{what}] {depths:?}");
        assert_eq!(depths[g].1, 3, "[{what}] {depths:?}");
        // Each directly under the one before: nothing shallower between.
        assert!(r < c && c < g, "[{what}] {depths:?}");
        assert!(
            depths[r + 1..c].iter().all(|(_, d)| *d >= 2),
            "[{what}] {depths:?}"
        );
        assert!(
            depths[c + 1..g].iter().all(|(_, d)| *d >= 3),
            "[{what}] {depths:?}"
        );
        assert!(
            html.contains("force-killed"),
            "[{what}] no forced kill marked"
        );
    };
    let page = s.get(&format!("/trees/{id}")).text().expect("tree page");
    check(&page, "server");
    if !Path::new("/usr/bin/chromium").exists() {
        skip("chromium not installed (Debian package chromium)");
        return;
    }
    let profile = tempfile::tempdir().expect("profile dir");
    let dom = chromium(
        profile.path(),
        &["--dump-dom"],
        &s.url(&format!("/trees/{id}")),
    );
    check(&String::from_utf8_lossy(&dom.stdout), "chromium");
}

/// An HTTP kill without `grace` of a tree this service does not own (a
/// `run`'s, on the same ledger) waits the grace recorded with the tree
/// (`--grace 400ms`); before issue 29 it waited the service's default.
#[test]
fn an_http_kill_of_a_tree_it_does_not_own_honours_its_recorded_grace() {
    let s = Server::start(&["--grace", "30s"]);
    let mut run = KillOnDrop(
        Command::new(bin())
            .env("TREEWARDEN_DATA_DIR", s.data_dir())
            .env("TREEWARDEN_BOUNDARY", "session")
            .args(["run", "--quiet", "--grace", "400ms", "--"])
            .args(["env", &format!("TW_TEST_MARK={}", s.mark), "sh", "-c"])
            .arg("trap '' TERM; sleep 300 & sleep 300 & wait")
            .stdin(Stdio::null())
            .spawn()
            .expect("run"),
    );
    let id = 1;
    // The tree appears once run has recorded it (404 before).
    let members = || {
        let r = s.get(&format!("/api/trees/{id}"));
        if r.status() != 200 {
            return 0;
        }
        let v: Value = r.json().unwrap_or(Value::Null);
        v["members"].as_array().map_or(0, |m| m.len())
    };
    assert!(
        wait_until(Duration::from_secs(20), || members() >= 3),
        "members did not appear: {}",
        members()
    );
    let (status, r) = s.post(&format!("/api/trees/{id}/kill"), None);
    assert_eq!(status, 200, "kill answered {r}");
    assert_eq!(r["state"], "ended", "{r}");
    let _ = crate::util::wait_child(&mut run.0, Duration::from_secs(20)).expect("run exits");
    let waited = crate::custody::waited_grace_ms(&s.export(), id);
    assert!((400..4000).contains(&waited), "waited {waited} ms");
}

/// A service that stops removes its socket file only while the file is
/// still the one it bound. Its listeners close first and its trees are torn
/// down after; a service started on the same path meanwhile (a supervisor's
/// quick restart) binds a new file there, which the old one removed at its
/// end, leaving the new service unreachable on the socket.
#[test]
fn a_stopping_service_never_removes_the_socket_its_successor_bound() {
    let dir = tempfile::tempdir().expect("temp dir");
    let sock = dir.path().join("api.sock");
    let sock_arg = sock.to_str().expect("utf-8 path");
    let mut old = Server::start(&["--socket", sock_arg]);
    // A tree that ignores SIGTERM for its 3 s grace keeps the old service
    // tearing down after its listeners closed.
    let mut body = old.body("trap '' TERM; sleep 300 & wait");
    body["grace"] = json!("3s");
    old.spawn(&body);
    assert!(
        wait_until(Duration::from_secs(10), || old.marked().len() >= 2),
        "the tree's shell and sleep"
    );
    let mut old_child = old.child.take().expect("the old service");
    signal(old_child.id(), rustix::process::Signal::TERM);
    assert!(
        wait_until(Duration::from_secs(10), || {
            std::os::unix::net::UnixStream::connect(&sock).is_err()
        }),
        "the old service's socket stopped answering"
    );
    let new = Server::start(&["--socket", sock_arg]);
    let status = wait_child(&mut old_child, Duration::from_secs(40));
    assert!(status.is_some(), "the old service ended: {}", old.stderr());
    let answer = Command::new("curl")
        .args([
            "-sS",
            "--max-time",
            "10",
            "-o",
            "/dev/null",
            "-w",
            "%{http_code}",
        ])
        .arg("--unix-socket")
        .arg(&sock)
        .arg("http://localhost/healthz")
        .output()
        .expect("curl");
    assert_eq!(
        String::from_utf8_lossy(&answer.stdout),
        "200",
        "the new service answers on its socket after the old one ended: {}; old: {}; new: {}",
        String::from_utf8_lossy(&answer.stderr),
        old.stderr(),
        new.stderr()
    );
    drop(new);
}
