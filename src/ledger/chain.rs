//! The hash chain: the canonical form of an event and its hash. Pure
//! functions, shared by the writer, `verify` and anyone replaying an export.

use sha2::{Digest, Sha256};

/// `prev_hash` of the first event.
pub const GENESIS: &str = "0000000000000000000000000000000000000000000000000000000000000000";

/// Writes `value` as canonical JSON: object keys sorted by their UTF-8 bytes,
/// no whitespace, strings escaped as serde_json escapes them. Independent of
/// serde_json's `preserve_order` feature.
pub fn canonical_json(value: &serde_json::Value, out: &mut String) {
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
                canonical_json(item, out);
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
                canonical_json(item, out);
            }
            out.push('}');
        }
    }
}

/// The canonical JSON text of a value.
pub fn canonical_string(value: &serde_json::Value) -> String {
    let mut out = String::new();
    canonical_json(value, &mut out);
    out
}

/// The canonical event: the JSON array `[seq,at,tree,kind,data]`, canonical.
pub fn canonical_event(
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
    canonical_string(&array)
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
    let mut hasher = Sha256::new();
    hasher.update(prev_hash.as_bytes());
    hasher.update(canonical_event(seq, at, tree, kind, data).as_bytes());
    hex::encode(hasher.finalize())
}

#[cfg(test)]
mod tests {
    use super::*;

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
}
