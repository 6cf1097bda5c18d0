//! The router in process (`tower::ServiceExt::oneshot`): every status the
//! API maps, and who may do what, without a listener. The service behind it
//! is real (a real ledger in a temp dir) but spawns nothing: its engine only
//! signals, and it has no reaper (this test binary's other tests wait for
//! their own children). Real listeners, spawns and users: tests/it.

use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::extract::ConnectInfo;
use axum::http::{Request, header};
use serde_json::{Value, json};
use tower::ServiceExt;

use super::auth::{Auth, token_hash};
use super::peer::{Peer, PeerCred};
use super::{AppState, router};
use crate::config::{BoundaryChoice, Config, ObserverMode};
use crate::custody::Engine;
use crate::ledger::{
    IdentityRecord, Ledger, LedgerOptions, NewTree, OnBehalfRecord, OwnerKind, OwnerRecord,
    Requester, TokenScope,
};
use crate::service::{Service, ServiceConfig};

struct Rig {
    _dir: tempfile::TempDir,
    state: AppState,
    ledger: Ledger,
    admin: String,
    reader: (i64, String),
    /// A tree asked for by uid 1000 over the socket, and one by root.
    users_tree: i64,
    roots_tree: i64,
}

fn rig(open_reads: bool) -> Rig {
    let dir = tempfile::tempdir().expect("tempdir");
    let config = Config {
        data_dir: dir.path().to_path_buf(),
        boundary: BoundaryChoice::Session,
        cgroup_root: None,
        busy_timeout: Duration::from_secs(2),
        ledger_reserve: 0,
        observer: ObserverMode::Off,
        observer_rcvbuf: 0,
    };
    let ledger = Ledger::open(
        &config.ledger_path(),
        LedgerOptions {
            busy_timeout: Duration::from_secs(2),
            ..LedgerOptions::default()
        },
    )
    .expect("ledger");
    let engine = Engine::signal_only(&config, ledger.clone(), None);
    let service = Service::without_reaper(
        engine,
        ServiceConfig {
            listen: "127.0.0.1:0".parse().expect("addr"),
            scan_interval: Duration::from_secs(1),
            full_scan_interval: Duration::from_secs(30),
            sweep_interval: Duration::from_secs(60),
            sweep_concurrency: 1,
            default_grace: Duration::from_millis(100),
            shutdown_grace: Duration::from_millis(100),
            max_grace: crate::http::api::DEFAULT_MAX_GRACE,
            drain_timeout: Duration::from_secs(1),
            ready_file: None,
            allow_commands: Vec::new(),
            allow_env: Vec::new(),
            observer: ObserverMode::Off,
            observer_rcvbuf: 0,
            log_max: 1 << 20,
            min_free: 0,
            max_trees_per_principal: 256,
            ended_logs: Default::default(),
        },
    )
    .expect("service");
    let by = Requester {
        via: "cli".into(),
        uid: Some(0),
        ..Requester::default()
    };
    let admin = "a".repeat(64);
    ledger
        .import_token("api-token file", &token_hash(&admin), &by)
        .expect("admin token");
    let read = "r".repeat(64);
    let read_id = ledger
        .create_token("reader", TokenScope::Read, &token_hash(&read), &by)
        .expect("read token");
    let owner = ledger
        .register_owner(&OwnerRecord {
            identity: IdentityRecord {
                pid: 4_000_000,
                start_ticks: 1,
                boot_id: "test".into(),
            },
            kind: OwnerKind::Service,
        })
        .expect("owner");
    let tree_of = |uid: u32| {
        ledger
            .create_tree_for(
                &NewTree {
                    label: None,
                    boundary: crate::proc::BoundaryKind::Session,
                    owner,
                    argv: vec!["sleep".into(), "1".into()],
                    cwd: None,
                    grace_ms: None,
                    timeout_ms: None,
                    limits: Default::default(),
                    first_signal: None,
                },
                Some(&OnBehalfRecord {
                    requester: Requester {
                        via: "socket".into(),
                        uid: Some(uid),
                        pid: Some(4_000_001),
                        ..Requester::default()
                    },
                    run_uid: Some(uid),
                    run_gid: Some(uid),
                }),
            )
            .expect("tree")
            .0
    };
    let users_tree = tree_of(1000);
    let roots_tree = tree_of(0);
    let state = AppState {
        service,
        auth: Arc::new(Auth::new(false, open_reads, None)),
    };
    Rig {
        _dir: dir,
        state,
        ledger,
        admin,
        reader: (read_id, read),
        users_tree,
        roots_tree,
    }
}

enum Via<'a> {
    Tcp(Option<&'a str>),
    Socket(u32),
}

async fn call(
    r: &Rig,
    via: Via<'_>,
    method: &str,
    path: &str,
    body: Option<Value>,
) -> (u16, Value) {
    let mut req = Request::builder()
        .method(method)
        .uri(path)
        .header(header::HOST, "127.0.0.1:7878");
    if let Via::Tcp(Some(t)) = via {
        req = req.header(header::AUTHORIZATION, format!("Bearer {t}"));
    }
    let body = match body {
        Some(b) => {
            req = req.header(header::CONTENT_TYPE, "application/json");
            Body::from(b.to_string())
        }
        None => Body::empty(),
    };
    let mut req = req.body(body).expect("request");
    let peer = match via {
        Via::Tcp(_) => Peer::Tcp("127.0.0.1:50000".parse().expect("addr")),
        Via::Socket(uid) => Peer::Unix(Some(PeerCred {
            pid: Some(4_000_002),
            uid,
            gid: uid,
        })),
    };
    req.extensions_mut().insert(ConnectInfo(peer));
    let resp = router(r.state.clone()).oneshot(req).await.expect("answer");
    let status = resp.status().as_u16();
    let bytes = axum::body::to_bytes(resp.into_body(), 1 << 20)
        .await
        .expect("body");
    (
        status,
        serde_json::from_slice(&bytes).unwrap_or(Value::Null),
    )
}

#[tokio::test]
async fn statuses_over_tcp_by_token_scope() {
    let r = rig(false);
    let admin = Some(r.admin.as_str());
    let read = Some(r.reader.1.as_str());
    // No token: only the open paths.
    assert_eq!(
        call(&r, Via::Tcp(None), "GET", "/api/trees", None).await.0,
        401
    );
    assert_eq!(
        call(&r, Via::Tcp(None), "GET", "/healthz", None).await.0,
        200
    );
    assert_eq!(
        call(&r, Via::Tcp(Some("nope")), "GET", "/healthz", None)
            .await
            .0,
        200,
        "the open paths look nothing up"
    );
    assert_eq!(
        call(&r, Via::Tcp(Some("nope")), "GET", "/api/trees", None)
            .await
            .0,
        401
    );
    // A read token reads everything, and may not change anything.
    let (s, v) = call(&r, Via::Tcp(read), "GET", "/api/trees?all=1", None).await;
    assert_eq!((s, v.as_array().map(Vec::len)), (200, Some(2)), "{v}");
    let (s, v) = call(
        &r,
        Via::Tcp(read),
        "POST",
        "/api/trees",
        Some(json!({"argv": ["true"]})),
    )
    .await;
    assert_eq!(s, 403, "{v}");
    assert!(
        v["error"]
            .as_str()
            .is_some_and(|e| e.contains("scope read")),
        "{v}"
    );
    let kill = format!("/api/trees/{}/kill", r.users_tree);
    assert_eq!(call(&r, Via::Tcp(read), "POST", &kill, None).await.0, 403);
    // The status mapping, with the admin token.
    for (method, path, body, want) in [
        ("GET", "/api/trees/999".to_string(), None, 404),
        ("GET", "/api/trees/x".to_string(), None, 400),
        ("GET", "/api/nothing".to_string(), None, 404),
        ("GET", "/api/trees?all=maybe".to_string(), None, 400),
        (
            "POST",
            "/api/trees".to_string(),
            Some(json!({"argv": []})),
            422,
        ),
        (
            "POST",
            "/api/trees".to_string(),
            Some(json!({"argv": ["true"], "bogus": 1})),
            422,
        ),
        (
            "POST",
            "/api/trees".to_string(),
            Some(json!({"argv": ["true"], "user": "no-such-user-tw17"})),
            422,
        ),
        // This service's engine only signals: a spawn is a conflict.
        (
            "POST",
            "/api/trees".to_string(),
            Some(json!({"argv": ["true"]})),
            409,
        ),
        (
            "POST",
            format!("/api/trees/{}/resolve", r.users_tree),
            Some(json!({"note": "x"})),
            409,
        ),
        (
            "POST",
            format!("/api/trees/{}/resolve", r.users_tree),
            Some(json!({"note": " "})),
            422,
        ),
    ] {
        let (s, v) = call(&r, Via::Tcp(admin), method, &path, body).await;
        assert_eq!(s, want, "{method} {path}: {v}");
        assert!(v["error"].is_string(), "{method} {path}: {v}");
    }
    // A revoked token is refused on the very next request.
    let by = Requester::default();
    assert!(r.ledger.revoke_token(r.reader.0, &by).expect("revoke"));
    assert_eq!(
        call(&r, Via::Tcp(read), "GET", "/api/trees", None).await.0,
        401
    );
}

#[tokio::test]
async fn open_reads_is_loopback_reads_only() {
    let r = rig(true);
    assert_eq!(
        call(&r, Via::Tcp(None), "GET", "/api/trees", None).await.0,
        200
    );
    assert_eq!(
        call(&r, Via::Tcp(None), "GET", "/api/export", None).await.0,
        200
    );
    let (s, _) = call(
        &r,
        Via::Tcp(None),
        "POST",
        "/api/trees",
        Some(json!({"argv": ["true"]})),
    )
    .await;
    assert_eq!(s, 401, "writes still need a token");
}

#[tokio::test]
async fn a_socket_principal_sees_and_acts_on_its_own_trees_only() {
    let r = rig(false);
    let (mine, roots) = (r.users_tree, r.roots_tree);
    let (s, v) = call(&r, Via::Socket(1000), "GET", "/api/trees?all=1", None).await;
    let ids: Vec<i64> = v
        .as_array()
        .map(|a| a.iter().filter_map(|t| t["id"].as_i64()).collect())
        .unwrap_or_default();
    assert_eq!((s, ids), (200, vec![mine]), "only its own tree is listed");
    assert_eq!(
        call(
            &r,
            Via::Socket(1000),
            "GET",
            &format!("/api/trees/{mine}"),
            None
        )
        .await
        .0,
        200
    );
    // Another's tree is an unknown tree to it: 404, the words of a tree
    // that does not exist (a 403 would tell which ids exist).
    for (method, path, body) in [
        ("GET", format!("/api/trees/{roots}"), None),
        ("GET", format!("/api/trees/{roots}/log"), None),
        ("GET", format!("/api/events?tree={roots}"), None),
        ("POST", format!("/api/trees/{roots}/kill"), None),
        (
            "POST",
            format!("/api/trees/{roots}/resolve"),
            Some(json!({"note": "mine now"})),
        ),
    ] {
        let (s, v) = call(&r, Via::Socket(1000), method, &path, body).await;
        assert_eq!(s, 404, "{method} {path}: {v}");
        assert_eq!(v["error"], format!("unknown tree {roots}"), "{v}");
    }
    for (method, path, body) in [
        ("GET", "/api/events".to_string(), None),
        ("GET", "/api/export".to_string(), None),
        ("GET", "/".to_string(), None),
        (
            "POST",
            "/api/trees".to_string(),
            Some(json!({"argv": ["true"], "user": "root"})),
        ),
        (
            "POST",
            "/api/trees".to_string(),
            Some(json!({"argv": ["true"], "owner_pid": 4_000_003})),
        ),
    ] {
        let (s, v) = call(&r, Via::Socket(1000), method, &path, body).await;
        assert_eq!(s, 403, "{method} {path}: {v}");
        assert!(v["error"].is_string(), "{v}");
    }
    assert_eq!(
        call(
            &r,
            Via::Socket(1000),
            "GET",
            &format!("/api/events?tree={mine}"),
            None
        )
        .await
        .0,
        200
    );
    // Root reads and acts on every tree (here the resolve reaches the
    // engine, which finds nothing ambiguous: 409, not 403).
    let (s, v) = call(&r, Via::Socket(0), "GET", "/api/trees?all=1", None).await;
    assert_eq!((s, v.as_array().map(Vec::len)), (200, Some(2)));
    let (s, v) = call(
        &r,
        Via::Socket(0),
        "POST",
        &format!("/api/trees/{mine}/resolve"),
        Some(json!({"note": "x"})),
    )
    .await;
    assert_eq!(s, 409, "{v}");
    // No token is asked for on the socket, whatever the Host.
    assert_eq!(
        call(&r, Via::Socket(0), "GET", "/api/export", None).await.0,
        200
    );
}

#[tokio::test]
async fn a_replaced_token_file_revokes_the_old_files_token() {
    let r = rig(false);
    let by = Requester::default();
    let old = r.admin.clone();
    let new = "b".repeat(64);
    let first = r
        .ledger
        .import_token("api-token file", &token_hash(&old), &by)
        .expect("import");
    assert_eq!(
        r.ledger
            .import_token("api-token file", &token_hash(&old), &by)
            .expect("again"),
        first,
        "the same file is imported once"
    );
    assert_eq!(
        call(&r, Via::Tcp(Some(&old)), "GET", "/api/trees", None)
            .await
            .0,
        200
    );
    let second = r
        .ledger
        .import_token("api-token file", &token_hash(&new), &by)
        .expect("new file");
    assert_ne!(first, second);
    assert_eq!(
        call(&r, Via::Tcp(Some(&old)), "GET", "/api/trees", None)
            .await
            .0,
        401
    );
    assert_eq!(
        call(&r, Via::Tcp(Some(&new)), "GET", "/api/trees", None)
            .await
            .0,
        200
    );
    let tokens = r.ledger.tokens().expect("list");
    let old_row = tokens
        .iter()
        .find(|t| t.id == first)
        .expect("kept, never deleted");
    assert!(old_row.revoked_at.is_some(), "{tokens:?}");
}

/// The `Link` of a user's page names only a tree of its own: a page read
/// for all and filtered after would name the next tree *of anyone's*, so
/// a user paging its own trees would learn other users' ids. The page is
/// read as the user may see it.
#[tokio::test]
async fn a_users_page_and_its_link_name_only_its_own_trees() {
    let r = rig(false);
    let req = Request::builder()
        .method("GET")
        .uri("/api/trees?all=1&limit=1")
        .header(header::HOST, "127.0.0.1:7878");
    let mut req = req.body(Body::empty()).expect("request");
    req.extensions_mut()
        .insert(ConnectInfo(Peer::Unix(Some(PeerCred {
            pid: Some(4_000_002),
            uid: 1000,
            gid: 1000,
        }))));
    let resp = router(r.state.clone()).oneshot(req).await.expect("answer");
    assert_eq!(resp.status().as_u16(), 200);
    let link = resp
        .headers()
        .get(header::LINK)
        .map(|v| v.to_str().unwrap_or_default().to_string());
    let bytes = axum::body::to_bytes(resp.into_body(), 1 << 20)
        .await
        .expect("body");
    let page: Value = serde_json::from_slice(&bytes).expect("json");
    let ids: Vec<i64> = page
        .as_array()
        .expect("a list")
        .iter()
        .filter_map(|t| t["id"].as_i64())
        .collect();
    assert_eq!(ids, [r.users_tree], "its own tree, on the first page");
    assert_eq!(link, None, "no next page: nothing else is its own");
    assert!(r.roots_tree > r.users_tree, "root's tree is the newer one");
}

#[tokio::test]
async fn only_an_admin_starts_the_drain_through_the_api() {
    let r = rig(false);
    let token = r.state.service.shutdown_token();
    let by = Requester {
        via: "cli".into(),
        uid: Some(0),
        ..Requester::default()
    };
    let spawner = "s".repeat(64);
    r.ledger
        .create_token("spawner", TokenScope::Spawn, &token_hash(&spawner), &by)
        .expect("spawn token");
    assert_eq!(
        call(&r, Via::Tcp(None), "POST", "/api/shutdown", None)
            .await
            .0,
        401
    );
    for t in [r.reader.1.as_str(), spawner.as_str()] {
        let (s, v) = call(&r, Via::Tcp(Some(t)), "POST", "/api/shutdown", None).await;
        assert_eq!(s, 403, "{v}");
    }
    let (s, v) = call(&r, Via::Socket(1000), "POST", "/api/shutdown", None).await;
    assert_eq!(s, 403, "a socket user that is no admin: {v}");
    assert!(!token.is_cancelled(), "no refused request started it");
    let asked = |r: &Rig| {
        r.ledger
            .events(&crate::ledger::EventFilter {
                kind_prefix: Some(crate::ledger::EventKind::ShutdownRequested.as_str().into()),
                ..Default::default()
            })
            .expect("events")
    };
    assert!(
        asked(&r).is_empty(),
        "no refused request is recorded as one"
    );
    let (s, v) = call(&r, Via::Tcp(Some(&r.admin)), "POST", "/api/shutdown", None).await;
    assert_eq!((s, &v["draining"]), (202, &json!(true)), "{v}");
    assert!(token.is_cancelled(), "the drain has begun");
    // Who asked is in the record, before the drain: the admin token, by
    // its id, over TCP, and the trees the service owned then.
    let rows = asked(&r);
    assert_eq!(rows.len(), 1, "{rows:?}");
    assert_eq!(rows[0].tree, None);
    match rows[0].event() {
        crate::ledger::Event::ShutdownRequested(e) => {
            assert_eq!(e.by.via, "tcp", "{e:?}");
            assert!(e.by.token_id.is_some(), "{e:?}");
            assert_eq!(e.owned_trees, v["owned_trees"].as_u64().expect("a count"));
        }
        other => panic!("not a shutdown request: {other:?}"),
    }
}
