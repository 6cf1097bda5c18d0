//! What `verify` and the sealer report (the first break, the seals'
//! proof, the seal events' data), and the export formats.

use serde::{Deserialize, Serialize};

/// The first thing `verify` found wrong.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct VerifyBreak {
    /// The event seq where the break is, when it is about an event.
    pub seq: Option<i64>,
    pub what: String,
}

impl std::fmt::Display for VerifyBreak {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.seq {
            Some(seq) => write!(f, "seq {seq}: {}", self.what),
            None => f.write_str(&self.what),
        }
    }
}

/// What `verify` checked and the first break, if any.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct VerifyReport {
    /// Events walked.
    pub events: u64,
    /// The newest event (seq, hash), if any.
    pub head: Option<(i64, String)>,
    /// `PRAGMA integrity_check` said "ok".
    pub integrity_ok: bool,
    pub first_break: Option<VerifyBreak>,
    /// The `ledger.checkpoint` the chain was proven from (its seq), when
    /// the ledger was pruned; for an archive, the checkpoint it matched.
    pub checkpoint: Option<i64>,
    /// For an export: what its last line (the `exported` trailer) proves,
    /// in a sentence (sealed, unauthenticated, or absent).
    pub trailer: Option<String>,
}

impl VerifyReport {
    pub fn is_ok(&self) -> bool {
        self.integrity_ok && self.first_break.is_none()
    }
}

/// The data of a `ledger.seal` event, typed (`op` names the variant).
/// Its `mac` is `hex(HMAC-SHA256(epoch key, canonical JSON of the data
/// without "mac"))`, so a field added, removed or changed breaks it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum SealData {
    /// `seal setup`: when epoch 0 starts and how long an epoch is; MACed
    /// with epoch 0's key.
    Setup(SealSetup),
    /// The seal of one ended epoch.
    Seal(EpochSeal),
    /// `seal close`: the writer stopped cleanly; seals the epoch it stopped in.
    Close(EpochSeal),
}

/// The setup of sealing, as the ledger records it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SealSetup {
    /// Epoch 0 starts here (RFC 3339, UTC, milliseconds); epoch N covers
    /// `[start + N*interval, start + (N+1)*interval)`.
    pub start: String,
    pub interval_ms: u64,
    /// HMAC seals: the MAC with epoch 0's key.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub mac: String,
    /// `ed25519` for public-key seals (absent: HMAC).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub scheme: Option<String>,
    /// Public-key seals: epoch 0's public key (the root `verify
    /// --seal-pub` is given), and the setup's signature with its key.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub public: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sig: Option<String>,
}

/// One epoch's seal: the chain's head just before the seal event (whose
/// own `prev_hash` it must equal), and when it was made.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct EpochSeal {
    pub epoch: u64,
    pub head_seq: i64,
    pub head_hash: String,
    pub made_at: String,
    /// Made more than one interval after its epoch ended (no sealer ran then).
    pub late: bool,
    /// The seal's form: absent in seals made before exports' trailers were
    /// sealed; 2 once they are (an export of such a ledger must carry an
    /// authenticated trailer).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub v: Option<u32>,
    /// HMAC seals: the MAC with the epoch's key.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub mac: String,
    /// Public-key seals: the next epoch's public key, which this seal
    /// certifies, and the seal's signature with its own epoch's key.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub next: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sig: Option<String>,
}

/// What `verify --seal-key` proved about the seals.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct SealReport {
    /// The setup event's seq.
    pub setup_seq: i64,
    pub interval_ms: u64,
    /// Seals checked (epochs 0 to `last_epoch`, consecutive).
    pub seals: u64,
    pub last_epoch: u64,
    /// The newest seal's seq and when it was made.
    pub last_seq: i64,
    pub last_made_at: String,
    /// The newest seal is a clean `seal close`.
    pub closed: bool,
    /// Seals made late (the epochs no sealer ran in), and the first of them.
    pub late: u64,
    pub first_late: Option<u64>,
    /// Events above the newest seal's head: not sealed yet.
    pub unsealed: u64,
    /// The time freshness was judged at (the read, or the export's own
    /// time); `None` for an export without one of a cleanly closed ledger.
    pub read_at: Option<String>,
}

/// Export formats.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
#[value(rename_all = "lowercase")]
pub enum ExportFormat {
    Ndjson,
    Csv,
    /// OCSF 1.5.0 Process Activity, one object per line: a view for SIEMs,
    /// not evidence (`ledger/ocsf.rs`).
    Ocsf,
}

impl std::str::FromStr for ExportFormat {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "ndjson" => Ok(Self::Ndjson),
            "csv" => Ok(Self::Csv),
            "ocsf" => Ok(Self::Ocsf),
            other => Err(format!(
                "unknown format {other:?}: expected ndjson, csv or ocsf"
            )),
        }
    }
}
