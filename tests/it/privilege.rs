//! Least privilege (issue 17), end to end: the real `treewarden serve`, its
//! Unix socket driven by curl as root and as a real second user (made here
//! with `useradd` and removed on every path), and its TCP listener driven
//! with scoped tokens made by the real `treewarden token` command.
//!
//! Ground truth is the kernel's and the workload's: the uid a tree runs
//! with is read from /proc/<pid>/status of its root, and printed by the
//! command itself (`id -u`) into its captured output.

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use serde_json::{Value, json};

use crate::serve::{Server, tool};
use crate::util::{bin, is_root, pid_alive, say, skip, wait_until};

/// A user made for one test, removed (with its group) when dropped.
pub(crate) struct TestUser {
    pub(crate) name: String,
    pub(crate) uid: u32,
    pub(crate) gid: u32,
}

impl TestUser {
    /// `None` (after a "skipped:" line) when this host cannot make one.
    pub(crate) fn create() -> Option<TestUser> {
        if !is_root() {
            skip("a second user needs root (useradd)");
            return None;
        }
        for t in ["useradd", "userdel", "setpriv", "curl"] {
            if tool(t).is_none() && !Path::new("/usr/sbin").join(t).is_file() {
                skip(&format!("{t} not installed"));
                return None;
            }
        }
        // One name per test: tests of this binary run side by side.
        static SEQ: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let n = SEQ.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        let name = format!("tw17u{}n{n}", std::process::id());
        let out = Command::new("useradd")
            .args([
                "--no-create-home",
                "--shell",
                "/usr/sbin/nologin",
                "--user-group",
            ])
            .arg(&name)
            .output()
            .expect("useradd");
        if !out.status.success() {
            skip(&format!(
                "useradd failed: {}",
                String::from_utf8_lossy(&out.stderr).trim()
            ));
            return None;
        }
        // From here on, Drop removes it.
        let mut user = TestUser {
            name,
            uid: 0,
            gid: 0,
        };
        let info = treewarden::proc::user_by_name(&user.name)
            .expect("user database")
            .expect("the user just made");
        user.uid = info.uid;
        user.gid = info.gid;
        assert_ne!(user.uid, 0);
        Some(user)
    }
}

impl Drop for TestUser {
    fn drop(&mut self) {
        // Its processes first (the tests end them by tree; this is the last
        // line of defence), by pid, never by name.
        if self.uid != 0 {
            for pid in processes_of(self.uid) {
                let _ = rustix::process::kill_process(
                    rustix::process::Pid::from_raw(pid).expect("pid"),
                    rustix::process::Signal::KILL,
                );
            }
        }
        let _ = Command::new("userdel").arg(&self.name).output();
        let _ = Command::new("groupdel").arg(&self.name).output();
    }
}

/// Pids whose real uid is `uid` (from /proc/<pid>/status).
pub(crate) fn processes_of(uid: u32) -> Vec<i32> {
    std::fs::read_dir("/proc")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok())
        .filter(|pid| status_ids(*pid, "Uid:").is_some_and(|ids| ids[0] == uid))
        .collect()
}

/// The four ids (real, effective, saved, filesystem) of a `Uid:`/`Gid:` line.
fn status_ids(pid: i32, key: &str) -> Option<Vec<u32>> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let line = status.lines().find(|l| l.starts_with(key))?;
    Some(
        line[key.len()..]
            .split_whitespace()
            .filter_map(|v| v.parse().ok())
            .collect(),
    )
}

/// A socket directory any user can traverse (a temp dir made 0755).
pub(crate) fn public_dir() -> tempfile::TempDir {
    let dir = tempfile::tempdir().expect("tempdir");
    std::fs::set_permissions(
        dir.path(),
        std::os::unix::fs::PermissionsExt::from_mode(0o755),
    )
    .expect("chmod");
    dir
}

/// One request on the Unix socket with curl, as root or as `user`:
/// (status, JSON body or the text as a string).
pub(crate) fn curl(
    sock: &Path,
    user: Option<&TestUser>,
    method: &str,
    path: &str,
    body: Option<&Value>,
) -> (u16, Value) {
    let (status, value, _) = curl_pid(sock, user, method, path, body);
    (status, value)
}

/// [`curl`], and the pid curl ran as (setpriv execs it: the same pid), which
/// the service sees as the peer's.
fn curl_pid(
    sock: &Path,
    user: Option<&TestUser>,
    method: &str,
    path: &str,
    body: Option<&Value>,
) -> (u16, Value, u32) {
    let mut cmd = match user {
        Some(u) => {
            let mut c = Command::new("setpriv");
            c.arg(format!("--reuid={}", u.uid))
                .arg(format!("--regid={}", u.gid))
                .arg("--clear-groups")
                .arg("curl");
            c
        }
        None => Command::new("curl"),
    };
    cmd.current_dir("/")
        .args(["-sS", "--max-time", "60", "--unix-socket"])
        .arg(sock)
        .args(["-X", method, "-w", "\n%{http_code}"]);
    if let Some(b) = body {
        cmd.args(["-H", "content-type: application/json", "-d"])
            .arg(b.to_string());
    }
    cmd.arg(format!("http://localhost{path}"))
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped());
    let child = cmd.spawn().expect("curl");
    let pid = child.id();
    let out = child.wait_with_output().expect("curl output");
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    let (body, code) = text.rsplit_once('\n').unwrap_or(("", &text));
    let status = code.trim().parse().unwrap_or_else(|_| {
        panic!(
            "curl {method} {path}: no status: {text} {}",
            String::from_utf8_lossy(&out.stderr)
        )
    });
    let value = serde_json::from_str(body).unwrap_or_else(|_| Value::String(body.to_string()));
    (status, value, pid)
}

pub(crate) fn spawn_body(s: &Server, script: &str) -> Value {
    json!({
        "argv": ["sh", "-c", script],
        "env": {"TW_TEST_MARK": s.mark},
        "grace": "200ms",
    })
}

/// The events of tree `id`, read as root over the socket.
pub(crate) fn events_of(sock: &Path, id: i64) -> Vec<Value> {
    let (status, v) = curl(sock, None, "GET", &format!("/api/events?tree={id}"), None);
    assert_eq!(status, 200, "{v}");
    v.as_array().cloned().unwrap_or_default()
}

#[test]
fn a_users_tree_runs_as_that_user_and_only_its_requester_or_root_acts_on_it() {
    let Some(user) = TestUser::create() else {
        return;
    };
    let public = public_dir();
    let sock = public.path().join("api.sock");
    // A secret in the service's environment must not reach a user's tree.
    let s = Server::start_with_env(
        &["--socket", sock.to_str().expect("utf-8 path")],
        &[("TW17_SERVICE_SECRET", "s3cret")],
    );
    let mode = std::fs::metadata(&sock).expect("socket").permissions();
    assert_eq!(
        std::os::unix::fs::PermissionsExt::mode(&mode) & 0o777,
        0o666,
        "any local user may connect"
    );

    // Root's tree, over the socket: no token.
    let (status, v) = curl(
        &sock,
        None,
        "POST",
        "/api/trees",
        Some(&spawn_body(&s, "exec sleep 300")),
    );
    assert_eq!(status, 201, "{v}; {}", s.stderr());
    let roots = v["id"].as_i64().expect("id");
    let roots_pid = v["root_pid"].as_i64().expect("root pid") as i32;
    assert_eq!(v["requester_uid"], 0, "{v}");
    assert_eq!(v["requested_by"]["via"], "socket", "{v}");
    assert_eq!(status_ids(roots_pid, "Uid:"), Some(vec![0; 4]));

    // The user's tree runs as the user: the kernel says so, and so does the
    // command itself.
    let (status, v, spawner_pid) = curl_pid(
        &sock,
        Some(&user),
        "POST",
        "/api/trees",
        Some(&spawn_body(
            &s,
            "id -u; id -g; pwd; echo \"$HOME $USER\"; echo \"${TW17_SERVICE_SECRET:-unset} $TW_TEST_MARK\"; exec sleep 300",
        )),
    );
    assert_eq!(status, 201, "{v}; {}", s.stderr());
    let users = v["id"].as_i64().expect("id");
    let users_pid = v["root_pid"].as_i64().expect("root pid") as i32;
    assert_eq!(v["requester_uid"], user.uid, "{v}");
    assert_eq!(v["run_uid"], user.uid, "{v}");
    assert_eq!(v["run_gid"], user.gid, "{v}");
    assert_eq!(
        v["requested_by"]["pid"].as_i64(),
        Some(i64::from(spawner_pid)),
        "the peer's pid (SO_PEERCRED) is recorded: {v}"
    );
    assert_eq!(status_ids(users_pid, "Uid:"), Some(vec![user.uid; 4]));
    assert_eq!(status_ids(users_pid, "Gid:"), Some(vec![user.gid; 4]));
    let log_path = format!("/api/trees/{users}/log");
    let mut log = String::new();
    assert!(
        wait_until(Duration::from_secs(10), || {
            log = curl(&sock, Some(&user), "GET", &log_path, None)
                .1
                .as_str()
                .unwrap_or_default()
                .to_string();
            log.lines().count() >= 5
        }),
        "the tree's output: {log:?}"
    );
    let lines: Vec<&str> = log.lines().collect();
    assert_eq!(lines[0], user.uid.to_string(), "{log}");
    assert_eq!(lines[1], user.gid.to_string(), "{log}");
    assert_eq!(lines[2], "/", "a tree that names no cwd starts in /: {log}");
    assert!(lines[3].ends_with(&format!(" {}", user.name)), "{log}");
    assert_eq!(
        lines[4],
        format!("unset {}", s.mark),
        "the service's environment stays the service's; the request's reaches the tree: {log}"
    );

    // The user sees only its own tree, and cannot act on root's.
    let (status, v) = curl(&sock, Some(&user), "GET", "/api/trees", None);
    assert_eq!(status, 200);
    let ids: Vec<i64> = v
        .as_array()
        .expect("list")
        .iter()
        .filter_map(|t| t["id"].as_i64())
        .collect();
    assert_eq!(ids, vec![users], "{v}");
    let (status, v) = curl(
        &sock,
        Some(&user),
        "POST",
        &format!("/api/trees/{roots}/kill"),
        None,
    );
    // Another's tree is answered as an unknown one, word for word: the
    // status tells nothing of which ids exist (issue 24).
    assert_eq!(status, 404, "{v}");
    assert_eq!(v["error"], format!("unknown tree {roots}"), "{v}");
    assert!(pid_alive(roots_pid), "a refused kill signalled nothing");
    let (status, v) = curl(
        &sock,
        Some(&user),
        "GET",
        &format!("/api/trees/{roots}"),
        None,
    );
    assert_eq!(status, 404, "{v}");
    let (status, unknown) = curl(&sock, Some(&user), "GET", "/api/trees/999999", None);
    assert_eq!(status, 404);
    assert_eq!(
        v["error"]
            .as_str()
            .map(|e| e.replace(&roots.to_string(), "N")),
        unknown["error"].as_str().map(|e| e.replace("999999", "N")),
        "the same words for another's and for no tree"
    );
    // Nor spawn as someone else, nor bind a tree to another process's life.
    let before = curl(&sock, None, "GET", "/api/trees?all=1", None).1;
    for (body, why) in [
        (json!({"argv": ["true"], "user": "root"}), "as root"),
        (
            json!({"argv": ["true"], "owner_pid": roots_pid}),
            "owned by another process",
        ),
    ] {
        let (status, v) = curl(&sock, Some(&user), "POST", "/api/trees", Some(&body));
        assert_eq!(status, 403, "{why}: {v}");
    }
    assert_eq!(
        curl(&sock, None, "GET", "/api/trees?all=1", None).1,
        before,
        "a refused spawn made no tree"
    );
    // A working directory closed to the user is the request's fault, found
    // by the child's chdir as the user (the service, root, could enter it).
    let closed_dir = tempfile::tempdir().expect("tempdir");
    std::fs::set_permissions(
        closed_dir.path(),
        std::os::unix::fs::PermissionsExt::from_mode(0o700),
    )
    .expect("chmod");
    let mut closed = spawn_body(&s, "true");
    closed["cwd"] = json!(closed_dir.path());
    let (status, v) = curl(&sock, Some(&user), "POST", "/api/trees", Some(&closed));
    assert_eq!(status, 422, "{v}; {}", s.stderr());
    assert!(
        v["error"]
            .as_str()
            .is_some_and(|e| e.contains("cwd is not usable")),
        "{v}"
    );

    // Root may run a tree as the user by name.
    let mut named = spawn_body(&s, "exec sleep 300");
    named["user"] = json!(user.name);
    let (status, v) = curl(&sock, None, "POST", "/api/trees", Some(&named));
    assert_eq!(status, 201, "{v}");
    let named_tree = v["id"].as_i64().expect("id");
    let named_pid = v["root_pid"].as_i64().expect("pid") as i32;
    assert_eq!(status_ids(named_pid, "Uid:"), Some(vec![user.uid; 4]));
    assert_eq!(v["requester_uid"], 0, "root asked: {v}");

    // Root kills the user's tree; the user kills... only its own.
    let (status, v) = curl(
        &sock,
        None,
        "POST",
        &format!("/api/trees/{users}/kill?grace=200ms"),
        None,
    );
    assert_eq!(status, 200, "{v}");
    assert!(wait_until(Duration::from_secs(10), || !pid_alive(
        users_pid
    )));
    let (status, v) = curl(
        &sock,
        Some(&user),
        "POST",
        &format!("/api/trees/{named_tree}/kill"),
        None,
    );
    // Root asked for it, though it runs as the user: to the user it is
    // another's tree, answered as an unknown one (issue 24).
    assert_eq!(status, 404, "{v}");
    assert_eq!(v["error"], format!("unknown tree {named_tree}"), "{v}");
    let (status, v) = curl(
        &sock,
        None,
        "POST",
        &format!("/api/trees/{roots}/kill?grace=200ms"),
        None,
    );
    assert_eq!(status, 200, "{v}");
    let (status, v) = curl(
        &sock,
        None,
        "POST",
        &format!("/api/trees/{named_tree}/kill?grace=200ms"),
        None,
    );
    assert_eq!(status, 200, "{v}");
    let mut own = spawn_body(&s, "exec sleep 300");
    own["label"] = json!("own");
    let (status, v) = curl(&sock, Some(&user), "POST", "/api/trees", Some(&own));
    assert_eq!(status, 201, "{v}");
    let own_tree = v["id"].as_i64().expect("id");
    let (status, v, own_kill_pid) = curl_pid(
        &sock,
        Some(&user),
        "POST",
        &format!("/api/trees/{own_tree}/kill?grace=200ms"),
        None,
    );
    assert_eq!(status, 200, "its own tree: {v}");

    // The principals are in the ledger: who asked (tree.created) and who
    // killed (the teardown's reason).
    let created = |id: i64| {
        events_of(&sock, id)
            .into_iter()
            .find(|e| e["kind"] == "tree.created")
            .expect("tree.created")
    };
    let by = &created(users)["data"]["by"];
    assert_eq!(
        (by["via"].clone(), by["uid"].clone()),
        (json!("socket"), json!(user.uid)),
        "{by}"
    );
    assert_eq!(created(named_tree)["data"]["run_uid"], user.uid);
    let killed_by = |id: i64| {
        events_of(&sock, id)
            .into_iter()
            .filter(|e| e["kind"] == "tree.state")
            .filter_map(|e| e["data"]["reason"].as_str().map(str::to_string))
            .find(|r| r.starts_with("killed through the API by"))
            .unwrap_or_default()
    };
    assert!(
        killed_by(users).contains("by uid 0 "),
        "{}",
        killed_by(users)
    );
    // And as a structured event, one per kill that was allowed: the user's
    // refused kill of root's tree left none.
    let requested = |id: i64| -> Vec<Value> {
        events_of(&sock, id)
            .into_iter()
            .filter(|e| e["kind"] == "kill.requested")
            .map(|e| e["data"]["by"].clone())
            .collect()
    };
    let by_uid =
        |id: i64| -> Vec<Value> { requested(id).iter().map(|b| b["uid"].clone()).collect() };
    assert_eq!(by_uid(roots), vec![json!(0)], "{:?}", requested(roots));
    assert_eq!(by_uid(users), vec![json!(0)]);
    assert_eq!(by_uid(own_tree), vec![json!(user.uid)]);
    assert_eq!(
        requested(own_tree)[0]["pid"],
        own_kill_pid,
        "the peer's pid"
    );
    assert!(
        killed_by(own_tree).contains(&format!("by uid {} ", user.uid)),
        "{}",
        killed_by(own_tree)
    );
    assert!(s.marked().is_empty() || wait_until(Duration::from_secs(10), || s.marked().is_empty()));
    drop(s);
}

/// `treewarden token ...` against the server's ledger.
fn token_cmd(s: &Server, args: &[&str]) -> std::process::Output {
    Command::new(bin())
        .env("TREEWARDEN_DATA_DIR", s.data_dir())
        .arg("token")
        .args(args)
        .output()
        .expect("treewarden token")
}

fn made(s: &Server, scope: &str, name: &str) -> (i64, String) {
    let out = token_cmd(s, &["create", "--scope", scope, "--name", name, "--json"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: Value = serde_json::from_slice(&out.stdout).expect("json");
    (
        v["id"].as_i64().expect("id"),
        v["token"].as_str().expect("token").to_string(),
    )
}

fn tcp(
    s: &Server,
    token: Option<&str>,
    method: reqwest::Method,
    path: &str,
    body: Option<&Value>,
) -> (u16, Value) {
    let client = reqwest::blocking::Client::builder()
        .no_proxy()
        .redirect(reqwest::redirect::Policy::none())
        .timeout(Duration::from_secs(60))
        .build()
        .expect("client");
    let mut req = client.request(method, s.url(path));
    if let Some(t) = token {
        req = req.bearer_auth(t);
    }
    if let Some(b) = body {
        req = req.json(b);
    }
    let r = req.send().expect("request");
    let status = r.status().as_u16();
    (status, r.json().unwrap_or(Value::Null))
}

#[test]
fn scoped_tokens_are_kept_as_hashes_bound_their_holders_and_revoke_at_once() {
    use reqwest::Method;
    let mut s = Server::start(&[]);
    // The api-token file is the first admin token.
    let out = token_cmd(&s, &["list", "--json"]);
    let list: Value = serde_json::from_slice(&out.stdout).expect("json");
    assert_eq!(list[0]["scope"], "admin", "{list}");
    let (read_id, read) = made(&s, "read", "dashboards");
    let (_, spawn) = made(&s, "spawn", "ci");
    // Only hashes are kept: no secret in the list, nor in the ledger file.
    let listed = String::from_utf8_lossy(&token_cmd(&s, &["list"]).stdout).to_string();
    assert!(
        listed.contains("dashboards") && listed.contains("ci"),
        "{listed}"
    );
    let ledger = std::fs::read(s.data_dir().join("ledger.db")).expect("ledger");
    for secret in [&read, &spawn, &s.token] {
        assert!(!listed.contains(secret.as_str()));
        assert!(
            !ledger.windows(secret.len()).any(|w| w == secret.as_bytes()),
            "a secret is in the ledger file"
        );
    }
    let body = s.body("exec sleep 300");
    // A read token reads, and may not spawn.
    assert_eq!(tcp(&s, Some(&read), Method::GET, "/api/trees", None).0, 200);
    let (status, v) = tcp(&s, Some(&read), Method::POST, "/api/trees", Some(&body));
    assert_eq!(status, 403, "{v}");
    // A spawn token spawns (recorded as itself), kills its own tree, and
    // not the admin's.
    let (status, v) = tcp(&s, Some(&spawn), Method::POST, "/api/trees", Some(&body));
    assert_eq!(status, 201, "{v}");
    let ci_tree = v["id"].as_i64().expect("id");
    assert_eq!(v["requested_by"]["token_name"], "ci", "{v}");
    assert_eq!(v["requester_uid"], Value::Null, "{v}");
    let (status, v) = tcp(&s, Some(&s.token), Method::POST, "/api/trees", Some(&body));
    assert_eq!(status, 201, "{v}");
    let admin_tree = v["id"].as_i64().expect("id");
    let (status, v) = tcp(
        &s,
        Some(&spawn),
        Method::POST,
        &format!("/api/trees/{admin_tree}/kill"),
        None,
    );
    assert_eq!(status, 403, "{v}");
    let (status, v) = tcp(
        &s,
        Some(&spawn),
        Method::POST,
        &format!("/api/trees/{ci_tree}/kill?grace=200ms"),
        None,
    );
    assert_eq!(status, 200, "{v}");
    let (_, events) = tcp(
        &s,
        Some(&s.token),
        Method::GET,
        &format!("/api/events?tree={ci_tree}"),
        None,
    );
    let by = events
        .as_array()
        .and_then(|a| a.iter().find(|e| e["kind"] == "kill.requested"))
        .map(|e| e["data"]["by"].clone())
        .expect("kill.requested");
    assert_eq!(
        (by["via"].clone(), by["token_name"].clone()),
        (json!("tcp"), json!("ci")),
        "{by}"
    );
    let (status, v) = tcp(
        &s,
        Some(&s.token),
        Method::POST,
        &format!("/api/trees/{admin_tree}/kill?grace=200ms"),
        None,
    );
    assert_eq!(status, 200, "{v}");
    // Revoked: refused on the next request, no restart.
    let out = token_cmd(&s, &["revoke", &read_id.to_string()]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let (status, v) = tcp(&s, Some(&read), Method::GET, "/api/trees", None);
    assert_eq!(status, 401, "{v}");
    assert_eq!(token_cmd(&s, &["revoke", "999"]).status.code(), Some(2));
    // Every token change is in the trail, with who made it.
    let events: Vec<Value> = tcp(&s, Some(&s.token), Method::GET, "/api/events", None)
        .1
        .as_array()
        .cloned()
        .unwrap_or_default();
    let revoked = events
        .iter()
        .find(|e| e["kind"] == "token.revoked")
        .expect("token.revoked");
    assert_eq!(revoked["data"]["token"], read_id);
    assert_eq!(revoked["data"]["by"]["via"], "cli");
    assert!(
        events
            .iter()
            .filter(|e| e["kind"] == "token.created")
            .count()
            >= 3
    );
    let status = s.terminate().expect("serve exits");
    assert_eq!(status.code(), Some(0), "{}", s.stderr());
    assert!(
        !s.data_dir().join("api.sock").exists(),
        "the socket is removed at exit"
    );
}

#[test]
fn the_dashboard_login_sets_an_httponly_strict_cookie_for_reads_only() {
    use reqwest::Method;
    let s = Server::start(&[]);
    let client = reqwest::blocking::Client::builder()
        .no_proxy()
        .redirect(reqwest::redirect::Policy::none())
        .build()
        .expect("client");
    let r = client
        .post(s.url("/login"))
        .header("content-type", "application/x-www-form-urlencoded")
        .body("token=wrong")
        .send()
        .expect("POST");
    assert_eq!(r.status(), 401);
    assert!(r.headers().get("set-cookie").is_none());
    let r = client
        .post(s.url("/login"))
        .header("content-type", "application/x-www-form-urlencoded")
        .body(format!("token={}", s.token))
        .send()
        .expect("POST");
    assert_eq!(r.status(), 303);
    let cookie = r
        .headers()
        .get("set-cookie")
        .and_then(|v| v.to_str().ok())
        .expect("a cookie")
        .to_string();
    assert!(
        cookie.contains("HttpOnly") && cookie.contains("SameSite=Strict"),
        "{cookie}"
    );
    let pair = cookie.split(';').next().expect("name=value").to_string();
    let page = client
        .get(s.url("/"))
        .header("cookie", &pair)
        .send()
        .expect("GET");
    assert_eq!(page.status(), 200);
    assert!(page.text().expect("page").contains("dispatch open"));
    // The cookie reads; it never writes (a cross-site form cannot use it).
    let r = client
        .post(s.url("/api/trees"))
        .header("cookie", &pair)
        .json(&s.body("true"))
        .send()
        .expect("POST");
    assert_eq!(r.status(), 401);
    assert_eq!(
        tcp(&s, None, Method::GET, "/", None).0,
        401,
        "no cookie, no token"
    );
}

#[test]
fn an_admin_group_member_reads_and_acts_on_every_tree() {
    let Some(user) = TestUser::create() else {
        return;
    };
    let public = public_dir();
    let sock = public.path().join("api.sock");
    // useradd --user-group made a group of the user's name.
    let s = Server::start(&[
        "--socket",
        sock.to_str().expect("utf-8 path"),
        "--admin-group",
        &user.name,
    ]);
    let (status, v) = curl(
        &sock,
        None,
        "POST",
        "/api/trees",
        Some(&spawn_body(&s, "exec sleep 300")),
    );
    assert_eq!(status, 201, "{v}");
    let roots = v["id"].as_i64().expect("id");
    let (status, v) = curl(&sock, Some(&user), "GET", "/api/trees", None);
    assert_eq!(status, 200);
    assert!(
        v.as_array().expect("list").iter().any(|t| t["id"] == roots),
        "an admin sees root's tree: {v}"
    );
    assert_eq!(curl(&sock, Some(&user), "GET", "/api/export", None).0, 200);
    // An admin acts on every tree, but still runs its own as itself.
    let (status, v) = curl(
        &sock,
        Some(&user),
        "POST",
        &format!("/api/trees/{roots}/kill?grace=200ms"),
        None,
    );
    assert_eq!(status, 200, "{v}");
    let (status, v) = curl(
        &sock,
        Some(&user),
        "POST",
        "/api/trees",
        Some(&json!({"argv": ["true"], "user": "root"})),
    );
    assert_eq!(status, 403, "only root names another user: {v}");
}

#[test]
fn over_the_socket_a_tree_may_be_bound_to_its_requesters_life() {
    if tool("curl").is_none() {
        skip("curl not installed");
        return;
    }
    let public = public_dir();
    let sock = public.path().join("api.sock");
    let s = Server::start(&["--socket", sock.to_str().expect("utf-8 path")]);
    // `exec` keeps the shell's pid for curl: the body names curl's own pid,
    // which the service checks against the peer credentials.
    let body = spawn_body(&s, "exec sleep 300").to_string();
    let body = body.replacen('{', "{\"owner_pid\": OWNER, ", 1);
    let script = format!(
        "exec curl -sS --max-time 60 --unix-socket '{}' -X POST -H 'content-type: application/json' -d \"$(echo '{}' | sed \"s/OWNER/$$/\")\" -w '\\n%{{http_code}}' http://localhost/api/trees",
        sock.display(),
        body
    );
    let child = Command::new("sh")
        .args(["-c", &script])
        .current_dir("/")
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("sh");
    let pid = child.id();
    let out = child.wait_with_output().expect("output");
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    let (json_body, code) = text.rsplit_once('\n').expect("status line");
    assert_eq!(code.trim(), "201", "{text}; {}", s.stderr());
    let v: Value = serde_json::from_str(json_body).expect("json");
    assert_eq!(v["owner"]["kind"], "client", "{v}");
    assert_eq!(
        v["owner"]["pid"], pid,
        "the owner is the requesting process: {v}"
    );
    assert_eq!(v["requested_by"]["pid"], pid, "{v}");
    // curl has exited: the tree follows it within a second or so.
    let id = v["id"].as_i64().expect("id");
    let root = v["root_pid"].as_i64().expect("root") as i32;
    assert!(
        wait_until(Duration::from_secs(10), || !pid_alive(root)),
        "the tree outlived its requester"
    );
    let (status, t) = curl(&sock, None, "GET", &format!("/api/trees/{id}"), None);
    assert_eq!(status, 200);
    assert!(
        wait_until(Duration::from_secs(10), || {
            let state =
                curl(&sock, None, "GET", &format!("/api/trees/{id}"), None).1["tree"]["state"]
                    .clone();
            state == "ended" || state == "vanished"
        }),
        "{t}"
    );
}

/// A socket client may bind a tree to a descendant's life (a harness's
/// worker), not to a process outside its own line: the kernel's parent
/// links decide, read when the spawn is asked for.
#[test]
fn a_non_root_requester_binds_a_tree_to_its_descendant_not_to_another_process() {
    if tool("curl").is_none() {
        skip("curl not installed");
        return;
    }
    let Some(user) = TestUser::create() else {
        return;
    };
    let public = public_dir();
    let sock = public.path().join("api.sock");
    let s = Server::start(&["--socket", sock.to_str().expect("utf-8 path")]);
    let body = json!({"argv": ["sh", "-c", "exec sleep 300"], "cwd": "/",
        "env": {"TW_TEST_MARK": s.mark}, "grace": "200ms"})
    .to_string()
    .replacen('{', "{\"owner_pid\": OWNER, ", 1);
    // As the user: a background sleep, then `exec curl` naming it, so the
    // owner is the requester's child.
    let script = format!(
        "sleep 300 >/dev/null 2>&1 & exec curl -sS --max-time 60 --unix-socket '{}' -X POST -H 'content-type: application/json' -d \"$(echo '{}' | sed \"s/OWNER/$!/\")\" -w '\\n%{{http_code}}' http://localhost/api/trees",
        sock.display(),
        body
    );
    let out = Command::new("setpriv")
        .arg(format!("--reuid={}", user.uid))
        .arg(format!("--regid={}", user.gid))
        .arg("--clear-groups")
        .args(["sh", "-c", &script])
        .current_dir("/")
        .stdout(std::process::Stdio::piped())
        .output()
        .expect("setpriv");
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    let (json_body, code) = text.rsplit_once('\n').expect("status line");
    assert_eq!(code.trim(), "201", "{text}; {}", s.stderr());
    let v: Value = serde_json::from_str(json_body).expect("json");
    let owner = v["owner"]["pid"].as_i64().expect("owner pid") as i32;
    let requester = v["requested_by"]["pid"].as_i64().expect("requester pid") as i32;
    assert_ne!(owner, requester, "{v}");
    assert!(pid_alive(owner), "the owner, the user's sleep, lives: {v}");
    // The owner's death ends the tree.
    let root = v["root_pid"].as_i64().expect("root") as i32;
    let id = v["id"].as_i64().expect("id");
    rustix::process::kill_process(
        rustix::process::Pid::from_raw(owner).expect("pid"),
        rustix::process::Signal::KILL,
    )
    .expect("kill the owner");
    assert!(
        wait_until(Duration::from_secs(10), || !pid_alive(root)),
        "the tree outlived its owner"
    );
    let (_, t) = curl(
        &sock,
        None,
        "GET",
        &format!("/api/trees/{id}/wait?timeout=10s"),
        None,
    );
    assert_eq!(t["outcome"]["kind"], "owner_gone", "{t}");
    // Another process (this test's own, root's): refused, nothing made.
    let before = curl(&sock, None, "GET", "/api/trees?all=1", None).1;
    let (status, v) = curl(
        &sock,
        Some(&user),
        "POST",
        "/api/trees",
        Some(&json!({"argv": ["true"], "cwd": "/", "owner_pid": std::process::id()})),
    );
    assert_eq!(status, 403, "{v}");
    assert_eq!(curl(&sock, None, "GET", "/api/trees?all=1", None).1, before);
}

/// Issue 24, finding 5 (groups): a requester that cleared its
/// supplementary groups got them back in its tree (the service asked the
/// user database, `getgrouplist`). The tree now has the groups the kernel
/// gives the requesting process: here none (curl runs under
/// `setpriv --clear-groups`), though the user database lists one more.
#[test]
fn a_users_tree_has_the_groups_the_kernel_gave_its_requester_not_the_user_databases() {
    let Some(user) = TestUser::create() else {
        return;
    };
    // One more group in the user database for this user.
    let extra = format!("{}x", user.name);
    struct Group(String);
    impl Drop for Group {
        fn drop(&mut self) {
            let _ = Command::new("groupdel").arg(&self.0).output();
        }
    }
    let made = Command::new("groupadd")
        .arg(&extra)
        .output()
        .expect("groupadd");
    if !made.status.success() {
        skip("groupadd failed");
        return;
    }
    let _group = Group(extra.clone());
    let added = Command::new("usermod")
        .args(["-a", "-G", &extra, &user.name])
        .output()
        .expect("usermod");
    assert!(
        added.status.success(),
        "{}",
        String::from_utf8_lossy(&added.stderr)
    );
    let info = treewarden::proc::user_by_name(&user.name)
        .expect("user database")
        .expect("the user");
    let listed = treewarden::proc::groups_of(&info, info.gid).expect("getgrouplist");
    assert!(
        listed.len() >= 2,
        "the database lists the extra group: {listed:?}"
    );

    let public = public_dir();
    let sock = public.path().join("api.sock");
    let s = Server::start(&["--socket", sock.to_str().expect("utf-8 path")]);
    let (status, v) = curl(
        &sock,
        Some(&user),
        "POST",
        "/api/trees",
        Some(&spawn_body(&s, "exec sleep 300")),
    );
    assert_eq!(status, 201, "{v}; {}", s.stderr());
    let pid = v["root_pid"].as_i64().expect("root pid") as i32;
    let groups = std::fs::read_to_string(format!("/proc/{pid}/status"))
        .expect("status")
        .lines()
        .find_map(|l| l.strip_prefix("Groups:").map(|g| g.trim().to_string()))
        .expect("a Groups: line");
    assert_eq!(groups, "", "the requester had none; the tree has none");
    let (status, _) = curl(
        &sock,
        Some(&user),
        "POST",
        &format!("/api/trees/{}/kill", v["id"]),
        None,
    );
    assert_eq!(status, 200);
}

/// Issue 24, finding 8 (cwd): whether a directory exists was answered by
/// the service as root ("not an existing directory" vs "Permission
/// denied" from the child), an oracle into directories closed to the user.
/// Now the child decides as the user, and both get the same answer.
#[test]
fn a_users_cwd_is_tried_as_that_user_with_one_answer_for_not_usable() {
    let Some(user) = TestUser::create() else {
        return;
    };
    let closed = tempfile::tempdir().expect("tempdir");
    std::fs::set_permissions(
        closed.path(),
        std::os::unix::fs::PermissionsExt::from_mode(0o700),
    )
    .expect("chmod");
    let inside = closed.path().join("exists");
    std::fs::create_dir(&inside).expect("a directory the user cannot reach");
    let public = public_dir();
    let sock = public.path().join("api.sock");
    let s = Server::start(&["--socket", sock.to_str().expect("utf-8 path")]);
    let answer = |cwd: &Path| {
        let mut body = spawn_body(&s, "true");
        body["cwd"] = json!(cwd.to_str().expect("utf-8"));
        curl(&sock, Some(&user), "POST", "/api/trees", Some(&body))
    };
    let (exists_status, exists) = answer(&inside);
    let (absent_status, absent) = answer(&closed.path().join("absent"));
    assert_eq!(exists_status, 422, "{exists}");
    assert_eq!(absent_status, 422, "{absent}");
    assert_eq!(exists["error"], absent["error"], "one answer for both");
    // Root's own tree still gets the plain check.
    let mut body = spawn_body(&s, "true");
    body["cwd"] = json!(closed.path().join("absent").to_str().expect("utf-8"));
    let (status, v) = curl(&sock, None, "POST", "/api/trees", Some(&body));
    assert_eq!(status, 422, "{v}");
}

/// A user's `cwd` through a magic link ran the tree in a directory of the
/// service's: `/proc/self/cwd` (resolved in the child, before its exec) is
/// the service's own working directory, `/dev/fd/N` and `/proc/self/fd/N`
/// a directory the service holds open, each reached without the search
/// checks of the closed folders above it. Now the service works from `/`,
/// and a cwd is resolved as the tree's user without magic links (a symlink
/// to one included): each form is refused with the one answer for a cwd
/// that user cannot use, and nothing runs. The service is started in a
/// folder anyone may write, below one closed to the user, so a tree that
/// got there would leave a file behind.
#[test]
fn a_users_cwd_through_a_magic_link_is_refused_and_nothing_runs() {
    let Some(user) = TestUser::create() else {
        return;
    };
    let closed = tempfile::tempdir().expect("tempdir");
    std::fs::set_permissions(
        closed.path(),
        std::os::unix::fs::PermissionsExt::from_mode(0o700),
    )
    .expect("chmod");
    let inside = closed.path().join("open");
    std::fs::create_dir(&inside).expect("a folder below the closed one");
    std::fs::set_permissions(&inside, std::os::unix::fs::PermissionsExt::from_mode(0o777))
        .expect("chmod");
    let public = public_dir();
    let sock = public.path().join("api.sock");
    let s = Server::start_in(&inside, &["--socket", sock.to_str().expect("utf-8 path")]);
    let pid = s.pid().expect("serve runs");
    // A directory the service holds open (its /proc handle, a cgroup).
    let held_dir = std::fs::read_dir(format!("/proc/{pid}/fd"))
        .expect("the service's descriptors")
        .flatten()
        .find(|e| {
            std::fs::read_link(e.path()).is_ok_and(|target| target.is_absolute() && target.is_dir())
        })
        .and_then(|e| e.file_name().to_str().map(str::to_owned));
    let link = public.path().join("here");
    std::os::unix::fs::symlink("/proc/self/cwd", &link).expect("a symlink to the magic link");
    let mut forms = vec![
        "/proc/self/cwd".to_string(),
        "/proc/self/cwd/.".to_string(),
        link.to_str().expect("utf-8").to_string(),
    ];
    // The tree's own stdin (a descriptor the request may choose), and a
    // directory the service holds open where it holds one.
    forms.extend(["/dev/fd/0".to_string(), "/proc/self/fd/0".to_string()]);
    match &held_dir {
        Some(n) => forms.extend([format!("/dev/fd/{n}"), format!("/proc/self/fd/{n}")]),
        None => say("no directory descriptor of the service's found: /dev/fd/0 tried only"),
    }
    let made = "tw-magic-link-made";
    for cwd in &forms {
        let mut body = spawn_body(&s, &format!("touch {made}"));
        body["cwd"] = json!(cwd);
        let (status, v) = curl(&sock, Some(&user), "POST", "/api/trees", Some(&body));
        assert_eq!(status, 422, "cwd {cwd}: {v}");
        assert_eq!(
            v["error"], "cannot start the tree: its cwd is not usable by the user it runs as",
            "cwd {cwd}"
        );
    }
    assert!(
        !inside.join(made).exists() && !Path::new("/").join(made).exists(),
        "a refused tree ran"
    );
    assert!(s.marked().is_empty(), "nothing runs: {:?}", s.marked());
    assert_eq!(
        std::fs::read_link(format!("/proc/{pid}/cwd")).expect("the service's cwd"),
        Path::new("/"),
        "the service works from /"
    );
    // A cwd the user may use still works (the same request otherwise).
    let usable = public.path().join("usable");
    std::fs::create_dir(&usable).expect("a folder the user may write");
    std::fs::set_permissions(&usable, std::os::unix::fs::PermissionsExt::from_mode(0o777))
        .expect("chmod");
    let mut body = spawn_body(&s, &format!("touch {made}"));
    body["cwd"] = json!(usable.to_str().expect("utf-8"));
    let (status, v) = curl(&sock, Some(&user), "POST", "/api/trees", Some(&body));
    assert_eq!(status, 201, "{v}");
    assert!(
        wait_until(Duration::from_secs(10), || usable.join(made).exists()),
        "the tree ran in its cwd"
    );
}

/// Issue 24, finding 5: a tree escaped its requester's own limits (a hard
/// `nofile` 64 became the service's 20,000; a cgroup v1 `pids.max` 20 ran
/// 100 jobs). Now the tree starts with the limits and v1 cgroups the kernel
/// holds for the requesting process. Ground truth: the tree's own shell
/// prints its limits and its v1 pids cgroup, and the v1 cgroup's own
/// counter (`pids.current`) never passes its `pids.max`.
#[test]
fn a_users_tree_gets_its_requesters_limits_and_v1_cgroups() {
    let Some(user) = TestUser::create() else {
        return;
    };
    if tool("prlimit").is_none() {
        skip("prlimit (util-linux) not installed");
        return;
    }
    // A v1 pids cgroup with room for 20, where the hybrid layout has one.
    struct V1(Option<std::path::PathBuf>);
    impl Drop for V1 {
        fn drop(&mut self) {
            if let Some(dir) = &self.0 {
                // Its processes end with the tree; a bounded wait, then rmdir.
                wait_until(Duration::from_secs(10), || std::fs::remove_dir(dir).is_ok());
            }
        }
    }
    let v1_root = Path::new("/sys/fs/cgroup/pids");
    let v1 = V1(v1_root
        .join("cgroup.procs")
        .exists()
        .then(|| v1_root.join(format!("tw-test-{}", std::process::id()))));
    if let Some(dir) = &v1.0 {
        std::fs::create_dir(dir).expect("a v1 pids cgroup");
        std::fs::write(dir.join("pids.max"), "20").expect("pids.max");
    } else {
        skip("no cgroup v1 pids hierarchy here (a pure v2 host): only the limits are checked");
    }
    let public = public_dir();
    let sock = public.path().join("api.sock");
    let s = Server::start(&["--socket", sock.to_str().expect("utf-8 path")]);
    // The requester: curl as the user, at hard nofile 64, in the v1 cgroup
    // (sh joins it, then execs prlimit, setpriv and curl: one pid).
    let body = spawn_body(
        &s,
        "echo \"nofile $(ulimit -Sn) $(ulimit -Hn)\"; grep ':pids:' /proc/self/cgroup || echo 'no v1 pids'; \
         n=0; while [ $n -lt 40 ]; do sleep 300 & n=$((n+1)); echo \"started $n\"; done; exec sleep 300",
    );
    let procs =
        v1.0.as_ref()
            .map(|d| d.join("cgroup.procs").display().to_string())
            .unwrap_or_else(|| "/dev/null".into());
    let out = Command::new("sh")
        .args(["-c", "echo $$ > \"$1\"; shift; exec \"$@\"", "sh", &procs])
        .args(["prlimit", "--nofile=64:64", "--"])
        .arg("setpriv")
        .arg(format!("--reuid={}", user.uid))
        .arg(format!("--regid={}", user.gid))
        .args([
            "--clear-groups",
            "curl",
            "-sS",
            "--max-time",
            "60",
            "--unix-socket",
        ])
        .arg(&sock)
        .args(["-X", "POST", "-H", "content-type: application/json", "-d"])
        .arg(body.to_string())
        .arg("http://localhost/api/trees")
        .current_dir("/")
        .output()
        .expect("curl as the user");
    let v: Value = serde_json::from_slice(&out.stdout).unwrap_or_else(|_| {
        panic!(
            "no JSON: {} {}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        )
    });
    let id = v["id"]
        .as_i64()
        .unwrap_or_else(|| panic!("{v}; {}", s.stderr()));
    let log_path = format!("/api/trees/{id}/log");
    let log = || {
        curl(&sock, None, "GET", &log_path, None)
            .1
            .as_str()
            .unwrap_or_default()
            .to_string()
    };
    // The shell stops starting jobs (fork fails and dash exits) or starts
    // all 40; either way its output settles.
    let mut text = String::new();
    assert!(
        wait_until(Duration::from_secs(20), || {
            text = log();
            text.contains("Cannot fork") || text.contains("started 40")
        }),
        "the tree's output: {text:?}"
    );
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines[0], "nofile 64 64", "the requester's limit: {text}");
    if let Some(dir) = &v1.0 {
        let name = dir.file_name().expect("name").to_str().expect("utf-8");
        assert!(
            lines[1].ends_with(&format!(":pids:/{name}")),
            "the tree's root is in the requester's v1 cgroup: {text}"
        );
        let current: u32 = std::fs::read_to_string(dir.join("pids.current"))
            .expect("pids.current")
            .trim()
            .parse()
            .expect("a number");
        assert!(current <= 20, "pids.current {current}");
        assert!(
            text.contains("Cannot fork") && !text.contains("started 40"),
            "the v1 pids.max of the requester bound its tree: {text}"
        );
    }
    let (status, v) = curl(&sock, None, "POST", &format!("/api/trees/{id}/kill"), None);
    assert_eq!(status, 200, "{v}");
}

/// Issue 24, finding 8 (PATH): the program was searched by the service as
/// root, so 126 vs 127 told whether a file existed in a directory closed
/// to the requester. Now the child searches after it took the user's ids:
/// a name in a closed directory gets the one answer the user's own shell
/// would give (EACCES), whether or not the file is there.
#[test]
fn a_users_program_is_searched_as_that_user_with_one_answer_for_closed_dirs() {
    let Some(user) = TestUser::create() else {
        return;
    };
    let closed = tempfile::tempdir().expect("tempdir");
    std::fs::set_permissions(
        closed.path(),
        std::os::unix::fs::PermissionsExt::from_mode(0o700),
    )
    .expect("chmod");
    let tool_path = closed.path().join("tw-secret-tool");
    std::fs::write(&tool_path, "#!/bin/sh\necho ran\n").expect("write");
    std::fs::set_permissions(
        &tool_path,
        std::os::unix::fs::PermissionsExt::from_mode(0o755),
    )
    .expect("chmod");
    let public = public_dir();
    let sock = public.path().join("api.sock");
    let s = Server::start(&["--socket", sock.to_str().expect("utf-8 path")]);
    let path_var = format!("{}:/usr/bin:/bin", closed.path().display());
    let answer = |who: Option<&TestUser>, program: &str| {
        let body = json!({
            "argv": [program],
            "env": {"TW_TEST_MARK": s.mark, "PATH": path_var},
            "grace": "200ms",
        });
        let (status, v) = curl(&sock, who, "POST", "/api/trees", Some(&body));
        (status, v.to_string().replace(program, "PROGRAM"))
    };
    let exists = answer(Some(&user), "tw-secret-tool");
    let absent = answer(Some(&user), "tw-no-such-tool");
    assert_ne!(exists.0, 201, "the user cannot run it: {exists:?}");
    assert_eq!(exists, absent, "one answer whether the file exists or not");
    assert!(
        exists.1.contains("not executable"),
        "EACCES, as the user's shell says: {exists:?}"
    );
    // Root searches as root: it runs the tool, and an absent one is 'not found'.
    let (status, v) = answer(None, "tw-no-such-tool");
    assert!(v.contains("command not found"), "{status} {v}");
    let (status, v) = answer(None, "tw-secret-tool");
    assert_eq!(status, 201, "{v}; {}", s.stderr());
}
