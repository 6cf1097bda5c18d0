//! The hash chain: the canonical form of an event and its hash. Pure
//! functions, shared by the writer, `verify` and anyone replaying an export.

use sha2::{Digest, Sha256};

/// `prev_hash` of the first event.
pub const GENESIS: &str = "0000000000000000000000000000000000000000000000000000000000000000";

/// The canonical form straight into bytes: no intermediate `String` per
/// scalar or key (an event naming 1,000 survivors has ~10,000 of them, and
/// it is written inside the kill authorization's transaction).
fn write_canonical(value: &serde_json::Value, out: &mut Vec<u8>) {
    use serde_json::Value;
    match value {
        Value::Null => out.extend_from_slice(b"null"),
        Value::Bool(true) => out.extend_from_slice(b"true"),
        Value::Bool(false) => out.extend_from_slice(b"false"),
        // `Number`'s Display is serde_json's own number text (itoa / ryu).
        Value::Number(n) => {
            use std::io::Write as _;
            let _ = write!(out, "{n}");
        }
        Value::String(s) => write_str(s, out),
        Value::Array(items) => {
            out.push(b'[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push(b',');
                }
                write_canonical(item, out);
            }
            out.push(b']');
        }
        Value::Object(map) => {
            let mut entries: Vec<(&String, &Value)> = map.iter().collect();
            // Already sorted unless serde_json keeps insertion order.
            if !entries.is_sorted_by(|a, b| a.0.as_bytes() <= b.0.as_bytes()) {
                entries.sort_by(|a, b| a.0.as_bytes().cmp(b.0.as_bytes()));
            }
            out.push(b'{');
            for (i, (key, item)) in entries.into_iter().enumerate() {
                if i > 0 {
                    out.push(b',');
                }
                write_str(key, out);
                out.push(b':');
                write_canonical(item, out);
            }
            out.push(b'}');
        }
    }
}

/// A JSON string literal, escaped exactly as serde_json escapes it.
fn write_str(s: &str, out: &mut Vec<u8>) {
    // Writing a `&str` into a `Vec` cannot fail.
    let _ = serde_json::to_writer(out, s);
}

/// The canonical JSON text of a value: object keys sorted by their UTF-8
/// bytes, no whitespace, strings escaped as serde_json escapes them.
/// Independent of serde_json's `preserve_order` feature.
pub fn canonical_string(value: &serde_json::Value) -> String {
    let mut out = Vec::new();
    write_canonical(value, &mut out);
    text(out)
}

/// Canonical bytes as text: only whole UTF-8 strings and ASCII were written.
fn text(bytes: Vec<u8>) -> String {
    String::from_utf8(bytes).unwrap_or_else(|e| String::from_utf8_lossy(e.as_bytes()).into_owned())
}

/// The canonical event: the JSON array `[seq,at,tree,kind,data]`, canonical.
pub fn canonical_event(
    seq: i64,
    at: &str,
    tree: Option<i64>,
    kind: &str,
    data: &serde_json::Value,
) -> String {
    let mut data_text = Vec::new();
    write_canonical(data, &mut data_text);
    text(event_bytes(seq, at, tree, kind, &data_text))
}

/// `[seq,at,tree,kind,` + the data's canonical text + `]`: what
/// [`canonical_event`] gives, around a data text already canonical.
fn event_bytes(seq: i64, at: &str, tree: Option<i64>, kind: &str, data_text: &[u8]) -> Vec<u8> {
    use std::io::Write as _;
    let mut out = Vec::with_capacity(data_text.len() + at.len() + kind.len() + 48);
    let _ = write!(out, "[{seq},");
    write_str(at, &mut out);
    match tree {
        Some(t) => {
            let _ = write!(out, ",{t},");
        }
        None => out.extend_from_slice(b",null,"),
    }
    write_str(kind, &mut out);
    out.push(b',');
    out.extend_from_slice(data_text);
    out.push(b']');
    out
}

/// `hex(sha256(prev_hash || canonical_event))`, lower-case hex; `prev_hash`
/// enters as its 64 ASCII hex characters.
pub fn event_hash(
    prev_hash: &str,
    seq: i64,
    at: &str,
    tree: Option<i64>,
    kind: &str,
    data: &serde_json::Value,
) -> String {
    event_hash_of_text(prev_hash, seq, at, tree, kind, &canonical_string(data))
}

/// [`event_hash`] for data already in canonical text ([`canonical_string`]):
/// the writer canonicalizes each event's data once, for the hash and the
/// stored text both.
pub fn event_hash_of_text(
    prev_hash: &str,
    seq: i64,
    at: &str,
    tree: Option<i64>,
    kind: &str,
    data_text: &str,
) -> String {
    let mut hasher = Sha256::new();
    hasher.update(prev_hash.as_bytes());
    hasher.update(event_bytes(seq, at, tree, kind, data_text.as_bytes()));
    hex::encode(hasher.finalize())
}

/// A Merkle tree over the chain's event hashes (RFC 9162 section 2.1):
/// leaf `i` is `sha256(0x00 || hash_i)` (the event's 32 hash bytes), an
/// inner node `sha256(0x01 || left || right)`; an odd node at the end of a
/// level is carried up unpaired, which is the RFC's split at the largest
/// power of two. A filtered export names the root over every event up to
/// its head and proves each event it holds by an inclusion path to it.
pub struct Merkle {
    /// `levels[0]` the leaves, the last level the root alone.
    levels: Vec<Vec<[u8; 32]>>,
}

/// The leaf of an event hash (64 hex digits); `None` when it is not one.
pub fn merkle_leaf(event_hash: &str) -> Option<[u8; 32]> {
    let bytes = <[u8; 32]>::try_from(hex::decode(event_hash).ok()?).ok()?;
    let mut h = Sha256::new();
    h.update([0u8]);
    h.update(bytes);
    Some(h.finalize().into())
}

fn merkle_node(left: &[u8; 32], right: &[u8; 32]) -> [u8; 32] {
    let mut h = Sha256::new();
    h.update([1u8]);
    h.update(left);
    h.update(right);
    h.finalize().into()
}

impl Merkle {
    /// The tree over `leaves` (in seq order).
    pub fn new(leaves: Vec<[u8; 32]>) -> Merkle {
        let mut levels = vec![leaves];
        while levels.last().is_some_and(|l| l.len() > 1) {
            let below = levels.last().map(Vec::as_slice).unwrap_or_default();
            let up = below
                .chunks(2)
                .map(|pair| match pair {
                    [l, r] => merkle_node(l, r),
                    [one] => *one,
                    _ => unreachable!("chunks(2) yields one or two"),
                })
                .collect();
            levels.push(up);
        }
        Merkle { levels }
    }

    pub fn size(&self) -> u64 {
        self.levels[0].len() as u64
    }

    /// The root: `sha256("")` for an empty tree.
    pub fn root(&self) -> [u8; 32] {
        match self.levels.last().and_then(|l| l.first()) {
            Some(root) if self.size() > 0 => *root,
            _ => Sha256::digest([]).into(),
        }
    }

    /// The inclusion path of leaf `index`, bottom up (RFC 9162 `PATH`).
    pub fn path(&self, index: u64) -> Vec<[u8; 32]> {
        let mut out = Vec::new();
        let mut i = index as usize;
        for level in &self.levels[..self.levels.len().saturating_sub(1)] {
            let sibling = i ^ 1;
            if sibling < level.len() {
                out.push(level[sibling]);
            }
            i >>= 1;
        }
        out
    }
}

/// RFC 9162 section 2.1.3.2: whether `leaf` is leaf `index` of the tree of
/// `size` leaves whose root is `root`, by `path`.
pub fn merkle_included(
    index: u64,
    size: u64,
    leaf: [u8; 32],
    path: &[[u8; 32]],
    root: &[u8; 32],
) -> bool {
    if index >= size {
        return false;
    }
    let (mut f, mut s) = (index, size - 1);
    let mut r = leaf;
    for p in path {
        if s == 0 {
            return false;
        }
        if f & 1 == 1 || f == s {
            r = merkle_node(p, &r);
            while f & 1 == 0 && f != 0 {
                f >>= 1;
                s >>= 1;
            }
        } else {
            r = merkle_node(&r, p);
        }
        f >>= 1;
        s >>= 1;
    }
    s == 0 && r == *root
}

#[cfg(test)]
mod tests {
    use super::*;

    /// RFC 9162's own definition of the tree hash: split at the largest
    /// power of two below n.
    fn mth(leaves: &[[u8; 32]]) -> [u8; 32] {
        match leaves.len() {
            0 => Sha256::digest([]).into(),
            1 => leaves[0],
            n => {
                let mut k = 1;
                while k * 2 < n {
                    k *= 2;
                }
                merkle_node(&mth(&leaves[..k]), &mth(&leaves[k..]))
            }
        }
    }

    #[test]
    fn the_merkle_tree_is_rfc_9162s_and_every_path_proves_its_leaf_alone() {
        let other = merkle_leaf(GENESIS).expect("leaf");
        for n in 0..40u64 {
            let leaves: Vec<[u8; 32]> = (0..n)
                .map(|i| merkle_leaf(&hex::encode(Sha256::digest(i.to_le_bytes()))).expect("leaf"))
                .collect();
            let tree = Merkle::new(leaves.clone());
            assert_eq!(tree.root(), mth(&leaves), "root of {n}");
            for i in 0..n {
                let path = tree.path(i);
                let root = tree.root();
                assert!(
                    merkle_included(i, n, leaves[i as usize], &path, &root),
                    "{i} of {n}"
                );
                assert!(!merkle_included(i, n, other, &path, &root));
                if n > 1 {
                    assert!(!merkle_included(
                        (i + 1) % n,
                        n,
                        leaves[i as usize],
                        &path,
                        &root
                    ));
                }
            }
        }
    }

    #[test]
    fn canonical_sorts_keys_and_drops_spaces() {
        let v: serde_json::Value =
            serde_json::from_str(r#"{ "b": [1, {"z": null, "a": "é\n"}], "a": true }"#)
                .expect("test json parses");
        assert_eq!(
            canonical_string(&v),
            r#"{"a":true,"b":[1,{"a":"é\n","z":null}]}"#
        );
    }

    #[test]
    fn event_hash_is_stable() {
        let data = serde_json::json!({"reason": "x"});
        let c = canonical_event(1, "2024-01-01T00:00:00.000Z", None, "kill.skipped", &data);
        assert_eq!(
            c,
            r#"[1,"2024-01-01T00:00:00.000Z",null,"kill.skipped",{"reason":"x"}]"#
        );
        let h = event_hash(
            GENESIS,
            1,
            "2024-01-01T00:00:00.000Z",
            None,
            "kill.skipped",
            &data,
        );
        assert_eq!(h.len(), 64);
        let mut hasher = Sha256::new();
        hasher.update(format!("{GENESIS}{c}").as_bytes());
        assert_eq!(h, hex::encode(hasher.finalize()));
    }

    /// The canonical form as it was first written (a `Value` per event, a
    /// `String` per scalar): the oracle the faster writer must equal byte
    /// for byte, or every chain written before stops verifying.
    fn oracle(value: &serde_json::Value, out: &mut String) {
        use serde_json::Value;
        match value {
            Value::Null | Value::Bool(_) | Value::Number(_) | Value::String(_) => {
                out.push_str(&value.to_string());
            }
            Value::Array(items) => {
                out.push('[');
                for (i, item) in items.iter().enumerate() {
                    if i > 0 {
                        out.push(',');
                    }
                    oracle(item, out);
                }
                out.push(']');
            }
            Value::Object(map) => {
                let mut entries: Vec<_> = map.iter().collect();
                entries.sort_by(|a, b| a.0.as_bytes().cmp(b.0.as_bytes()));
                out.push('{');
                for (i, (key, item)) in entries.into_iter().enumerate() {
                    if i > 0 {
                        out.push(',');
                    }
                    out.push_str(&serde_json::Value::String(key.clone()).to_string());
                    out.push(':');
                    oracle(item, out);
                }
                out.push('}');
            }
        }
    }

    fn oracle_event(
        seq: i64,
        at: &str,
        tree: Option<i64>,
        kind: &str,
        data: &serde_json::Value,
    ) -> String {
        let array = serde_json::Value::Array(vec![
            seq.into(),
            at.into(),
            tree.map_or(serde_json::Value::Null, Into::into),
            kind.into(),
            data.clone(),
        ]);
        let mut out = String::new();
        oracle(&array, &mut out);
        out
    }

    fn json_value() -> impl proptest::strategy::Strategy<Value = serde_json::Value> {
        use proptest::prelude::*;
        let leaf = prop_oneof![
            Just(serde_json::Value::Null),
            any::<bool>().prop_map(serde_json::Value::from),
            any::<i64>().prop_map(serde_json::Value::from),
            any::<u64>().prop_map(serde_json::Value::from),
            any::<f64>()
                .prop_filter("JSON numbers are finite", |f| f.is_finite())
                .prop_map(serde_json::Value::from),
            ".*".prop_map(serde_json::Value::from),
            "[\\u{0}-\\u{1f}\"\\\\é\\u{2028}\\u{1F600}]{0,6}".prop_map(serde_json::Value::from),
        ];
        leaf.prop_recursive(4, 64, 8, |inner| {
            prop_oneof![
                proptest::collection::vec(inner.clone(), 0..6).prop_map(serde_json::Value::Array),
                proptest::collection::vec((".{0,4}", inner), 0..6)
                    .prop_map(|kv| { serde_json::Value::Object(kv.into_iter().collect()) }),
            ]
        })
    }

    proptest::proptest! {
        #[test]
        fn the_fast_canonical_form_is_the_original_byte_for_byte(
            data in json_value(),
            seq in proptest::prelude::any::<i64>(),
            tree in proptest::option::of(proptest::prelude::any::<i64>()),
            at in ".{0,30}",
            kind in "[a-z.\"\\\\]{0,20}",
        ) {
            let mut want = String::new();
            oracle(&data, &mut want);
            proptest::prop_assert_eq!(&canonical_string(&data), &want);
            let event = oracle_event(seq, &at, tree, &kind, &data);
            proptest::prop_assert_eq!(&canonical_event(seq, &at, tree, &kind, &data), &event);
            let mut hasher = Sha256::new();
            hasher.update(GENESIS.as_bytes());
            hasher.update(event.as_bytes());
            let hash = hex::encode(hasher.finalize());
            proptest::prop_assert_eq!(&event_hash(GENESIS, seq, &at, tree, &kind, &data), &hash);
            proptest::prop_assert_eq!(
                &event_hash_of_text(GENESIS, seq, &at, tree, &kind, &canonical_string(&data)),
                &hash
            );
        }
    }
}
