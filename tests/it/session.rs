//! The dashboard's login, end to end: the real `treewarden serve` on
//! 127.0.0.1:0, its login form driven by headless Chromium over the
//! DevTools protocol (`--remote-debugging-pipe`), and a stub server on
//! another loopback port that records every request head a browser sends
//! it. Browsers send a host's cookies to every port of it; these tests
//! hold that what they send there is no token and writes nothing, and that
//! a session reads only while it lives: until its expiry, and until its
//! token is revoked.
//!
//! Chromium runs as a process-group leader in its own temp profile, and is
//! ended by that group. Only 127.0.0.1 is ever contacted.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError, channel};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use reqwest::blocking::Client;
use serde_json::{Value, json};

use crate::serve::Server;
use crate::util::{bin, skip, wait_child, wait_until};

pub(crate) const CHROMIUM: &str = "/usr/bin/chromium";

/// A client that does not follow redirects (the tests read them).
fn client() -> Client {
    Client::builder()
        .no_proxy()
        .redirect(reqwest::redirect::Policy::none())
        .timeout(Duration::from_secs(60))
        .build()
        .expect("client")
}

/// Every `Set-Cookie` of a response.
fn set_cookies(r: &reqwest::blocking::Response) -> Vec<String> {
    r.headers()
        .get_all("set-cookie")
        .iter()
        .filter_map(|v| v.to_str().ok())
        .map(str::to_string)
        .collect()
}

/// `POST /login` with `token` (and `next`): the response, unread.
fn login(s: &Server, token: &str, next: Option<&str>) -> reqwest::blocking::Response {
    let mut form = form_urlencoded::Serializer::new(String::new());
    form.append_pair("token", token);
    if let Some(n) = next {
        form.append_pair("next", n);
    }
    client()
        .post(s.url("/login"))
        .header("content-type", "application/x-www-form-urlencoded")
        .body(form.finish())
        .send()
        .expect("POST /login")
}

/// Logs in with `token`: the session cookie's `name=value`.
pub(crate) fn session_cookie(s: &Server, token: &str) -> String {
    let r = login(s, token, None);
    assert_eq!(r.status(), 303, "login refused");
    let cookies = set_cookies(&r);
    let ours = cookies
        .iter()
        .find(|c| c.starts_with("treewarden_session_"))
        .unwrap_or_else(|| panic!("no session cookie in {cookies:?}"));
    ours.split(';').next().expect("name=value").to_string()
}

/// A dashboard read with `cookie`: its status.
fn read_with_cookie(s: &Server, cookie: &str) -> u16 {
    client()
        .get(s.url("/api/trees"))
        .header("cookie", cookie)
        .send()
        .expect("GET")
        .status()
        .as_u16()
}

/// How many trees the ledger holds (read with the admin token).
fn tree_count(s: &Server) -> usize {
    let r = s.get("/api/trees?all=1");
    assert_eq!(r.status(), 200);
    r.json::<Value>()
        .expect("json")
        .as_array()
        .map_or(0, Vec::len)
}

/// Tries `cookie` (`name=value`) every way a thief could to spawn, and
/// asserts each is refused (401/403) and that no tree was made.
fn assert_cannot_spawn_with(s: &Server, cookie: &str) {
    let before = tree_count(s);
    let value = cookie.split_once('=').map_or(cookie, |(_, v)| v);
    let c = client();
    let tries = [
        c.post(s.url("/api/trees")).bearer_auth(value),
        c.post(s.url("/api/trees")).bearer_auth(cookie),
        c.post(s.url("/api/trees")).header("cookie", cookie),
        c.post(s.url("/api/trees"))
            .header("cookie", format!("treewarden_token={value}")),
    ];
    for (n, req) in tries.into_iter().enumerate() {
        let status = req.json(&s.body("true")).send().expect("POST").status();
        assert!(
            status == 401 || status == 403,
            "try {n} with {cookie:?} answered {status}"
        );
    }
    assert_eq!(tree_count(s), before, "no tree was made");
}

/// A token made with the real `treewarden token create`: (id, secret).
pub(crate) fn make_token(s: &Server, scope: &str, name: &str) -> (i64, String) {
    let out = Command::new(bin())
        .env("TREEWARDEN_DATA_DIR", s.data_dir())
        .args([
            "token", "create", "--scope", scope, "--name", name, "--json",
        ])
        .output()
        .expect("treewarden token create");
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

fn revoke_token(s: &Server, id: i64) {
    let out = Command::new(bin())
        .env("TREEWARDEN_DATA_DIR", s.data_dir())
        .args(["token", "revoke", &id.to_string()])
        .output()
        .expect("treewarden token revoke");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn the_session_cookie_holds_no_token_and_only_reads() {
    let s = Server::start(&[]);
    let r = login(&s, &s.token, None);
    assert_eq!(r.status(), 303);
    assert_eq!(
        r.headers().get("location").and_then(|v| v.to_str().ok()),
        Some("/")
    );
    let cookies = set_cookies(&r);
    let body = r.text().expect("body");
    assert!(!body.contains(&s.token), "the token is not echoed");
    for c in &cookies {
        assert!(!c.contains(&s.token), "a token in Set-Cookie: {c}");
    }
    let port = s.addr.rsplit(':').next().expect("port");
    let ours = cookies
        .iter()
        .find(|c| c.starts_with("treewarden_session_"))
        .expect("a session cookie");
    let (name, value) = ours
        .split(';')
        .next()
        .and_then(|p| p.split_once('='))
        .expect("name=value");
    // Named for this instance: the ledger's id, then this port.
    let parts: Vec<&str> = name.split('_').collect();
    assert_eq!(parts.len(), 4, "{name}");
    assert!(
        parts[2].len() == 8 && parts[2].bytes().all(|b| b.is_ascii_hexdigit()),
        "{name}"
    );
    assert_eq!(parts[3], port, "{name}");
    assert!(
        value.len() == 64 && value.bytes().all(|b| b.is_ascii_hexdigit()),
        "{value}"
    );
    assert_ne!(value, s.token);
    for attr in ["HttpOnly", "SameSite=Strict", "Path=/", "Max-Age=43200"] {
        assert!(ours.contains(attr), "{attr} missing: {ours}");
    }
    // The cookie older versions set (the token itself) is cleared.
    assert!(
        cookies
            .iter()
            .any(|c| c.starts_with("treewarden_token=;") && c.contains("Max-Age=0")),
        "{cookies:?}"
    );
    let pair = format!("{name}={value}");
    // It reads, the dashboard and the API.
    assert_eq!(read_with_cookie(&s, &pair), 200);
    let page = client()
        .get(s.url("/"))
        .header("cookie", &pair)
        .send()
        .expect("GET /");
    assert_eq!(page.status(), 200);
    assert!(page.text().expect("page").contains("dispatch open"));
    // The admin token's session writes nothing, whichever way it is sent.
    assert_cannot_spawn_with(&s, &pair);
    // Its value is no bearer token, even for a read.
    let r = client()
        .get(s.url("/api/trees"))
        .bearer_auth(value)
        .send()
        .expect("GET");
    assert_eq!(r.status(), 401);
    // The old cookie is not read any more: a token in it is not used.
    assert_eq!(
        read_with_cookie(&s, &format!("treewarden_token={}", s.token)),
        401
    );
    // Another instance's name, with this value: not this service's cookie.
    assert_eq!(
        read_with_cookie(&s, &format!("treewarden_session_00000000_1={value}")),
        401
    );
}

#[test]
fn a_session_ends_at_its_expiry() {
    let s = Server::start(&["--session-ttl", "2s"]);
    let start = Instant::now();
    let pair = session_cookie(&s, &s.token);
    assert_eq!(read_with_cookie(&s, &pair), 200, "read before expiry");
    assert!(
        wait_until(Duration::from_secs(30), || read_with_cookie(&s, &pair)
            == 401),
        "the session still reads after 30 s with --session-ttl 2s"
    );
    assert!(
        start.elapsed() >= Duration::from_millis(1900),
        "ended after {:?}, before its ttl",
        start.elapsed()
    );
    // The session ended, not the token.
    assert_eq!(s.get("/api/trees").status(), 200);
    // A browser sent to the form once its session ended.
    let r = client()
        .get(s.url("/events"))
        .header("cookie", &pair)
        .header("accept", "text/html")
        .send()
        .expect("GET");
    assert_eq!(r.status(), 303);
    assert_eq!(
        r.headers().get("location").and_then(|v| v.to_str().ok()),
        Some("/login?next=%2Fevents")
    );
}

#[test]
fn a_session_ends_with_its_tokens_revocation() {
    let s = Server::start(&[]);
    let (id, token) = make_token(&s, "admin", "dashboard");
    let pair = session_cookie(&s, &token);
    let other = session_cookie(&s, &s.token);
    assert_eq!(read_with_cookie(&s, &pair), 200);
    revoke_token(&s, id);
    // At once: the very next request, no wait.
    assert_eq!(read_with_cookie(&s, &pair), 401, "revoked token's session");
    assert_eq!(read_with_cookie(&s, &pair), 401, "and it stays dead");
    // Another token's session is untouched.
    assert_eq!(read_with_cookie(&s, &other), 200);
    // The revoked token opens no new session.
    let r = login(&s, &token, None);
    assert_eq!(r.status(), 401);
    assert!(set_cookies(&r).is_empty());
}

#[test]
fn a_deep_link_survives_login_and_next_never_leaves_the_origin() {
    let s = Server::start(&[]);
    let (status, v) = s.post("/api/trees", Some(&s.body("true")));
    assert_eq!(status, 201, "{v}");
    let id = v["id"].as_i64().expect("id");
    let deep = format!("/trees/{id}");
    let r = client()
        .get(s.url(&deep))
        .header("accept", "text/html")
        .send()
        .expect("GET");
    assert_eq!(r.status(), 303);
    let to = r
        .headers()
        .get("location")
        .and_then(|v| v.to_str().ok())
        .expect("location")
        .to_string();
    assert_eq!(to, format!("/login?next=%2Ftrees%2F{id}"));
    let form = client().get(s.url(&to)).send().expect("GET form");
    assert_eq!(form.status(), 200);
    let form = form.text().expect("form");
    assert!(
        form.contains(&format!(r#"name="next" value="{deep}""#)),
        "{form}"
    );
    let r = login(&s, &s.token, Some(&deep));
    assert_eq!(r.status(), 303);
    assert_eq!(
        r.headers().get("location").and_then(|v| v.to_str().ok()),
        Some(deep.as_str())
    );
    // A query survives too.
    let r = client()
        .get(s.url("/?all=1&state=ended"))
        .header("accept", "text/html")
        .send()
        .expect("GET");
    let to = r
        .headers()
        .get("location")
        .and_then(|v| v.to_str().ok())
        .expect("location")
        .to_string();
    assert_eq!(to, "/login?next=%2F%3Fall%3D1%26state%3Dended");
    let form = client()
        .get(s.url(&to))
        .send()
        .expect("GET form")
        .text()
        .expect("form");
    // The `&` HTML-escaped, as askama writes it (`&#38;`) or as `&amp;`.
    assert!(
        form.contains(r#"value="/?all=1&#38;state=ended""#)
            || form.contains(r#"value="/?all=1&amp;state=ended""#),
        "{form}"
    );
    // Anything that could leave this origin goes to `/`, on the form and
    // after login, and is never echoed.
    for bad in [
        "//evil.example/",
        "/\\evil.example",
        "\\\\evil.example",
        "http://evil.example/",
        "https:evil.example",
        "/\t/evil.example",
        "javascript:alert(1)",
    ] {
        let r = login(&s, &s.token, Some(bad));
        assert_eq!(r.status(), 303, "{bad:?}");
        assert_eq!(
            r.headers().get("location").and_then(|v| v.to_str().ok()),
            Some("/"),
            "{bad:?}"
        );
        let form = client()
            .get(s.url(&format!(
                "/login?{}",
                form_urlencoded::Serializer::new(String::new())
                    .append_pair("next", bad)
                    .finish()
            )))
            .send()
            .expect("GET form")
            .text()
            .expect("form");
        assert!(form.contains(r#"name="next" value="/""#), "{bad:?}: {form}");
        assert!(!form.contains("evil.example"), "{bad:?}: {form}");
    }
}

/// One request head a [`Recorder`] received, as sent.
type Heads = Arc<Mutex<Vec<Vec<u8>>>>;

/// A server on another loopback port that records the head of every
/// request it gets and answers a small page: what a local user's dev
/// server would see of an operator's browser.
struct Recorder {
    addr: String,
    heads: Heads,
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Recorder {
    fn start() -> Recorder {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind the recorder");
        let addr = listener.local_addr().expect("addr").to_string();
        let heads: Heads = Arc::default();
        let stop = Arc::new(AtomicBool::new(false));
        let (h, st) = (heads.clone(), stop.clone());
        let thread = std::thread::spawn(move || {
            for conn in listener.incoming() {
                if st.load(Ordering::SeqCst) {
                    break;
                }
                let Ok(conn) = conn else { continue };
                let _ = conn.set_read_timeout(Some(Duration::from_secs(10)));
                let mut reader = BufReader::new(match conn.try_clone() {
                    Ok(c) => c,
                    Err(_) => continue,
                });
                let mut head = Vec::new();
                loop {
                    let mut line = Vec::new();
                    if reader.read_until(b'\n', &mut line).unwrap_or(0) == 0 {
                        break;
                    }
                    head.extend_from_slice(&line);
                    if line == b"\r\n" || line == b"\n" {
                        break;
                    }
                }
                if head.is_empty() {
                    continue;
                }
                h.lock().expect("heads").push(head);
                let page =
                    "<!doctype html><title>elsewhere</title><p id=\"elsewhere\">another server</p>";
                let mut conn = conn;
                let _ = write!(
                    conn,
                    "HTTP/1.1 200 OK\r\ncontent-type: text/html\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{page}",
                    page.len()
                );
            }
        });
        Recorder {
            addr,
            heads,
            stop,
            thread: Some(thread),
        }
    }

    fn heads(&self) -> Vec<Vec<u8>> {
        self.heads.lock().expect("heads").clone()
    }
}

impl Drop for Recorder {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        // Wakes the accept loop, which then sees the flag.
        let _ = TcpStream::connect(&self.addr);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Headless Chromium driven over the DevTools protocol on a pipe: its
/// commands on fd 3, its answers on fd 4 (NUL-terminated JSON), here its
/// stdin and stdout, moved there by `sh` before it execs Chromium.
pub(crate) struct Browser {
    child: Child,
    commands: ChildStdin,
    answers: Receiver<Value>,
    next_id: u64,
    /// The flat session of the page target every command goes to.
    session: String,
    _profile: tempfile::TempDir,
}

impl Browser {
    pub(crate) fn start() -> Browser {
        let profile = tempfile::tempdir().expect("profile dir");
        let stderr = std::fs::File::create(profile.path().join("chromium.stderr")).expect("stderr");
        let mut child = Command::new("sh")
            .args(["-c", "exec \"$@\" 3<&0 4>&1 </dev/null >/dev/null", "sh"])
            .arg(CHROMIUM)
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
                "--remote-debugging-pipe",
            ])
            .arg(format!(
                "--user-data-dir={}",
                profile.path().join("p").display()
            ))
            .arg("about:blank")
            .process_group(0)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(stderr)
            .spawn()
            .expect("chromium");
        let commands = child.stdin.take().expect("stdin");
        let mut out = child.stdout.take().expect("stdout");
        let (tx, answers) = channel();
        std::thread::spawn(move || {
            let mut buf = Vec::new();
            let mut chunk = [0u8; 65536];
            loop {
                let n = match out.read(&mut chunk) {
                    Ok(0) | Err(_) => return,
                    Ok(n) => n,
                };
                buf.extend_from_slice(&chunk[..n]);
                while let Some(end) = buf.iter().position(|&b| b == 0) {
                    let msg: Vec<u8> = buf.drain(..=end).collect();
                    if let Ok(v) = serde_json::from_slice::<Value>(&msg[..msg.len() - 1])
                        && tx.send(v).is_err()
                    {
                        return;
                    }
                }
            }
        });
        let mut b = Browser {
            child,
            commands,
            answers,
            next_id: 0,
            session: String::new(),
            _profile: profile,
        };
        let target = b.call(None, "Target.createTarget", json!({"url": "about:blank"}));
        let target = target["targetId"].as_str().expect("targetId").to_string();
        let attached = b.call(
            None,
            "Target.attachToTarget",
            json!({"targetId": target, "flatten": true}),
        );
        b.session = attached["sessionId"]
            .as_str()
            .expect("sessionId")
            .to_string();
        b
    }

    /// One command and its result (bounded: 30 s).
    pub(crate) fn call(&mut self, session: Option<&str>, method: &str, params: Value) -> Value {
        self.next_id += 1;
        let id = self.next_id;
        let mut msg = json!({"id": id, "method": method, "params": params});
        if let Some(s) = session {
            msg["sessionId"] = json!(s);
        }
        let mut bytes = serde_json::to_vec(&msg).expect("json");
        bytes.push(0);
        self.commands
            .write_all(&bytes)
            .and_then(|()| self.commands.flush())
            .expect("write to chromium");
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.answers.recv_timeout(left) {
                Ok(v) if v["id"] == id => {
                    assert!(v.get("error").is_none(), "{method}: {v}");
                    return v["result"].clone();
                }
                Ok(_) => {}
                Err(RecvTimeoutError::Timeout) => panic!("{method}: no answer in 30 s"),
                Err(RecvTimeoutError::Disconnected) => panic!("{method}: chromium closed the pipe"),
            }
        }
    }

    /// A command to the page.
    pub(crate) fn page(&mut self, method: &str, params: Value) -> Value {
        let session = self.session.clone();
        self.call(Some(&session), method, params)
    }

    /// The value of `expr` in the page.
    pub(crate) fn eval(&mut self, expr: &str) -> Value {
        self.page(
            "Runtime.evaluate",
            json!({"expression": expr, "returnByValue": true}),
        )["result"]["value"]
            .clone()
    }

    /// The page's address once it has loaded one for which `done` holds
    /// (bounded: 30 s).
    pub(crate) fn wait_for(&mut self, what: &str, done: impl Fn(&str) -> bool) -> String {
        let mut href = String::new();
        let ok = wait_until(Duration::from_secs(30), || {
            let state = self.eval("document.readyState + ' ' + location.href");
            let state = state.as_str().unwrap_or("");
            href = state.split_once(' ').map_or("", |(_, h)| h).to_string();
            state.starts_with("complete ") && done(&href)
        });
        assert!(ok, "{what}: the page stayed at {href}");
        href
    }

    /// Opens `deep` (a URL of `s`) signed out, types `s`'s token into the
    /// login form it is sent to, and waits until it is back on `deep`.
    pub(crate) fn sign_in_through(&mut self, s: &Server, deep: &str) {
        self.navigate(deep);
        self.wait_for("the login form", |h| h.contains("/login?next="));
        self.eval("document.getElementById('token').focus()");
        self.page("Input.insertText", json!({"text": s.token}));
        self.eval("document.querySelector('form button[type=submit]').click()");
        self.wait_for("the deep link after login", |h| h == deep);
    }

    pub(crate) fn navigate(&mut self, url: &str) {
        self.page("Page.navigate", json!({"url": url}));
    }
}

impl Drop for Browser {
    fn drop(&mut self) {
        // Its own group: the browser and every helper process it started.
        if let Some(pgid) = rustix::process::Pid::from_raw(self.child.id() as i32) {
            let _ = rustix::process::kill_process_group(pgid, rustix::process::Signal::KILL);
        }
        let _ = wait_child(&mut self.child, Duration::from_secs(10));
    }
}

#[test]
fn a_browser_logged_in_here_gives_another_loopback_port_nothing_that_writes() {
    if !Path::new(CHROMIUM).exists() {
        skip("chromium not installed (Debian package chromium)");
        return;
    }
    let s = Server::start(&[]);
    let (status, v) = s.post("/api/trees", Some(&s.body("true")));
    assert_eq!(status, 201, "{v}");
    let id = v["id"].as_i64().expect("id");
    let elsewhere = Recorder::start();
    let mut b = Browser::start();
    // A deep link, unauthenticated: the browser is sent to the form, where
    // the token is typed into the real form and submitted; signed in, it is
    // back on the page it asked for.
    let deep = s.url(&format!("/trees/{id}"));
    b.sign_in_through(&s, &deep);
    let text = b.eval("document.body.innerText");
    assert!(
        text.as_str().unwrap_or("").contains(&format!("Tree {id}")),
        "{text}"
    );
    // The operator then visits a page on another loopback port.
    let other = format!("http://{}/index.html", elsewhere.addr);
    b.navigate(&other);
    b.wait_for("the other port's page", |h| h == other);
    assert!(
        wait_until(Duration::from_secs(10), || !elsewhere.heads().is_empty()),
        "the other port got no request"
    );
    let heads = elsewhere.heads();
    let token = s.token.as_bytes();
    for head in &heads {
        assert!(
            !head.windows(token.len()).any(|w| w == token),
            "the token reached another port: {}",
            String::from_utf8_lossy(head)
        );
    }
    // The browser did send this service's cookie there (cookies ignore
    // ports): what it carried is what a local user holds now.
    let received: Vec<String> = heads
        .iter()
        .flat_map(|h| {
            String::from_utf8_lossy(h)
                .lines()
                .filter_map(|l| {
                    l.split_once(':')
                        .filter(|(k, _)| k.eq_ignore_ascii_case("cookie"))
                        .map(|(_, v)| v.trim().to_string())
                })
                .collect::<Vec<_>>()
        })
        .flat_map(|v| {
            v.split(';')
                .map(|c| c.trim().to_string())
                .collect::<Vec<_>>()
        })
        .collect();
    let stolen: Vec<&String> = received
        .iter()
        .filter(|c| c.starts_with("treewarden_"))
        .collect();
    assert!(
        !stolen.is_empty(),
        "the browser sent no treewarden cookie to the other port: {received:?}"
    );
    for cookie in &stolen {
        assert_cannot_spawn_with(&s, cookie);
    }
    // The same cookie does read the dashboard here: it is the live session.
    let session = stolen
        .iter()
        .find(|c| c.starts_with("treewarden_session_"))
        .expect("the session cookie");
    let page = client()
        .get(s.url(&format!("/trees/{id}")))
        .header("cookie", session.as_str())
        .send()
        .expect("GET");
    assert_eq!(page.status(), 200);
    assert!(page.text().expect("page").contains(&format!("Tree {id}")));
    let _ = b.call(None, "Browser.close", json!({}));
}
