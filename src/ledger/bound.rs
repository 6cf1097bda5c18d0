//! Bounded evidence: what a request or a process hands the ledger is
//! stored up to a size per field, and past it truncated with the whole
//! field's length and SHA-256 (unbounded, 30 refused spawns with a 1 MiB
//! argv each added 59 MB to the ledger in 1.4 s).
//!
//! The digest is of the whole field as the kernel would hold it: the
//! arguments joined by NUL bytes (as `/proc/<pid>/cmdline`, without the
//! trailing NUL), or the text itself; so a reviewer holding the original
//! can prove it is the one recorded.

use std::borrow::Cow;

use serde_json::{Value, json};
use sha2::{Digest, Sha256};

use super::types::MemberRecord;

/// The most a field keeps (bytes): argv (all arguments together), a
/// label, a member's command line.
pub const FIELD_MAX: usize = 64 * 1024;

/// `s` cut to at most `max` bytes, at a character boundary.
fn cut(s: &str, max: usize) -> &str {
    let mut end = max.min(s.len());
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    &s[..end]
}

/// What was cut: the whole field's length in bytes, its argument count
/// where it is a list, and its SHA-256 (hex).
fn truncation(bytes: usize, args: Option<usize>, digest: [u8; 32]) -> Value {
    let mut v = json!({"bytes": bytes, "sha256": hex::encode(digest)});
    if let Some(n) = args {
        v["args"] = json!(n);
    }
    v
}

/// `argv` as stored: whole when its arguments and their NUL separators
/// fit [`FIELD_MAX`], else the arguments that fit (the last one cut) and
/// what was cut.
pub fn argv(args: &[String]) -> (Cow<'_, [String]>, Option<Value>) {
    let total: usize = args.iter().map(String::len).sum::<usize>() + args.len().saturating_sub(1);
    if total <= FIELD_MAX {
        return (Cow::Borrowed(args), None);
    }
    let mut hasher = Sha256::new();
    let mut kept = Vec::new();
    let mut room = FIELD_MAX;
    for (i, a) in args.iter().enumerate() {
        if i > 0 {
            hasher.update([0u8]);
        }
        hasher.update(a.as_bytes());
        if room > 0 {
            let part = cut(a, room);
            room -= part.len();
            kept.push(part.to_string());
            room = room.saturating_sub(1);
        }
    }
    let digest: [u8; 32] = hasher.finalize().into();
    (
        Cow::Owned(kept),
        Some(truncation(total, Some(args.len()), digest)),
    )
}

/// A text field as stored: whole up to [`FIELD_MAX`], else cut, with what
/// was cut.
pub fn text(s: &str) -> (Cow<'_, str>, Option<Value>) {
    if s.len() <= FIELD_MAX {
        return (Cow::Borrowed(s), None);
    }
    let digest: [u8; 32] = Sha256::digest(s.as_bytes()).into();
    (
        Cow::Owned(cut(s, FIELD_MAX).to_string()),
        Some(truncation(s.len(), None, digest)),
    )
}

/// `args` replaced by their digest, for a tree past its evidence budget
/// (`evidence.rs`): the stored argv is one string naming the whole argv's
/// SHA-256, length in bytes and argument count; the same facts, with
/// `over_budget` (the budget in bytes), go into the event's
/// `cmdline_truncated`. Stable: the same argv always gives the same string.
pub fn digested(args: &[String], budget: u64) -> (Vec<String>, Value) {
    let total: usize = args.iter().map(String::len).sum::<usize>() + args.len().saturating_sub(1);
    let mut hasher = Sha256::new();
    for (i, a) in args.iter().enumerate() {
        if i > 0 {
            hasher.update([0u8]);
        }
        hasher.update(a.as_bytes());
    }
    let digest: [u8; 32] = hasher.finalize().into();
    let mut cut = truncation(total, Some(args.len()), digest);
    cut["over_budget"] = json!(budget);
    let kept = vec![format!(
        "sha256:{} bytes:{total} args:{}",
        hex::encode(digest),
        args.len()
    )];
    (kept, cut)
}

/// A member record with its command line bounded (the rest as read).
pub fn member(m: &MemberRecord) -> (Cow<'_, MemberRecord>, Option<Value>) {
    match argv(&m.cmdline) {
        (Cow::Borrowed(_), None) => (Cow::Borrowed(m), None),
        (kept, cut) => (
            Cow::Owned(MemberRecord {
                cmdline: kept.into_owned(),
                ..m.clone()
            }),
            cut,
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn small_fields_are_kept_whole_and_large_ones_cut_with_their_length_and_digest() {
        let small = vec!["sleep".to_string(), "1".to_string()];
        assert!(matches!(argv(&small), (Cow::Borrowed(_), None)));
        let big = vec!["echo".to_string(), "é".repeat(100_000)];
        let whole = format!("echo\0{}", "é".repeat(100_000));
        let (kept, cut) = argv(&big);
        let cut = cut.expect("cut");
        assert_eq!(cut["bytes"], whole.len());
        assert_eq!(cut["args"], 2);
        assert_eq!(cut["sha256"], hex::encode(Sha256::digest(whole.as_bytes())));
        let stored: usize = kept.iter().map(String::len).sum::<usize>() + kept.len() - 1;
        assert!(stored <= FIELD_MAX, "{stored}");
        assert_eq!(kept[0], "echo");
        assert!(
            kept[1].chars().all(|c| c == 'é'),
            "cut at a character boundary"
        );
        let label = "x".repeat(FIELD_MAX + 1);
        let (t, c) = text(&label);
        assert_eq!(t.len(), FIELD_MAX);
        assert_eq!(c.expect("cut")["bytes"], FIELD_MAX + 1);
    }
}
