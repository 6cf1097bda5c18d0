//! What a client and a verifier read, byte for byte: the OpenAPI document
//! the real `serve` answers is the one in `fixtures/openapi.json`. A change
//! of the document is a change of the contract; it is made on purpose
//! (`TREEWARDEN_BLESS=1` rewrites the fixture, and the diff is reviewed),
//! never as the side effect of moving code.

use std::path::PathBuf;

use crate::serve::Server;

fn fixture() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/it/fixtures/openapi.json")
}

#[test]
fn the_openapi_document_is_the_fixture_byte_for_byte() {
    let s = Server::start(&[]);
    let r = s.get("/api/openapi.json");
    assert_eq!(r.status(), 200, "GET /api/openapi.json");
    let got = r.bytes().expect("body").to_vec();
    if std::env::var_os("TREEWARDEN_BLESS").is_some() {
        std::fs::write(fixture(), &got).expect("write the fixture");
    }
    let want = std::fs::read(fixture()).expect("the fixture (TREEWARDEN_BLESS=1 writes it)");
    if got != want {
        let at = got
            .iter()
            .zip(&want)
            .position(|(a, b)| a != b)
            .unwrap_or(got.len().min(want.len()));
        let around = |b: &[u8]| {
            String::from_utf8_lossy(&b[at.saturating_sub(80)..(at + 80).min(b.len())]).into_owned()
        };
        panic!(
            "the OpenAPI document moved at byte {at} ({} bytes, fixture {}):\n  served:  {}\n  fixture: {}",
            got.len(),
            want.len(),
            around(&got),
            around(&want)
        );
    }
}
