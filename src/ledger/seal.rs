//! Sealed evidence: forward-secure seals over the hash chain,
//! after journald's Forward Secure Sealing and the lessons of its bugs.
//!
//! # Keys
//!
//! `seal setup` makes a 32-byte seed from the kernel's random source and
//! prints it once, as 64 hex digits: the *verification key*, which the
//! operator keeps off the host. The host keeps only the key of the epoch it
//! is in, in `<data-dir>/seal.key` (0600; never in SQLite, whose WAL and
//! free pages would keep old keys). Keys are derived one way:
//!
//! ```text
//! key(0)   = sha256("treewarden seal v1 key 0" || seed)
//! key(n+1) = sha256("treewarden seal v1 next"  || key(n))
//! mac      = hex(hmac_sha256(key(n), canonical JSON of the data without "mac"))
//! ```
//!
//! so a host compromised in epoch T holds key(T) and can derive no key of an
//! earlier epoch: it cannot make a seal for one. `verify --seal-key` derives
//! every key from the seed.
//!
//! # Epochs and seals
//!
//! The setup event (`ledger.seal`, op `setup`, MACed with key(0)) records
//! when epoch 0 starts and the interval. Epoch N covers
//! `[start + N*interval, start + (N+1)*interval)`. Once epoch N has ended,
//! a sealer appends its seal (op `seal`): the chain's head just before the
//! seal event (seq and hash: the seal event's own `prev_hash`), the time it
//! was made, MACed with key(N); then it derives key(N+1), overwrites the key
//! file in place with it and fsyncs: only then does the seal count. Every
//! epoch is sealed, events or not (CVE-2023-31438).
//!
//! Who seals: `serve` on a timer of its own (`service/seal.rs`), and
//! `treewarden seal now` (a cron job on a host without the service). Epochs
//! in which no sealer ran are sealed by the next one, at once, in order,
//! each marked `late` and with the time it was really made: the key of such
//! an epoch stayed on the host past its end, so a late seal proves only
//! that the events it covers were there when it was made (docs/THREAT-MODEL.md).
//! `seal close` (and the service's shutdown) seals the current epoch early
//! as op `close`: the writer stopped cleanly, and `verify` then asks for no
//! fresher seal. A later sealer goes on with the next epoch (late seals).
//!
//! # Public-key seals
//!
//! `seal setup --pub FILE` seals with Ed25519 instead (`scheme: ed25519`
//! in the setup), so that a verifier holds no secret and cannot make a seal:
//! each epoch has a key pair drawn from the kernel's random source; the
//! setup names epoch 0's public key (the *root*, written to FILE and printed
//! once, for the auditor) and is signed with its key; the seal of epoch N
//! names epoch N+1's public key (`next`) and is signed with epoch N's key,
//! which is then overwritten in the key file. `verify --seal-pub FILE`
//! follows the certificates from the root: a seal signed with any key but
//! its epoch's (a later one root found on the host) fails. The key file
//! holds epoch N's key and the next one's (so a crash after a seal's commit
//! loses no certified key); a public-key ledger seals one epoch per
//! transaction. `verify --seal-pub` on a ledger also looks through its data
//! dir's files for the private key of any sealed epoch, which must be gone.
//!
//! The key file is one fixed-size record (`{"epoch","key","setup"}`,
//! padded to 256 bytes) overwritten at offset 0 and fsynced, under an
//! exclusive `flock` that every sealer takes for its whole run, so two
//! processes never seal one epoch twice. A crash after a seal's commit and
//! before the key's overwrite leaves the key one epoch behind the ledger:
//! the next sealer evolves it past the ledger's newest seal before anything else.

use std::fs::File;
use std::io::Read;

use super::fsmode::Mode as _;

use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

use ed25519_dalek::{Signature, Signer as _, SigningKey, Verifier as _, VerifyingKey};
use hmac::{Hmac, KeyInit, Mac};
use rusqlite::{Connection, OptionalExtension};
use sha2::{Digest, Sha256};

use super::Ledger;
use super::chain;
use super::db::Durability;
use super::error::{Fail, LedgerError};
use super::event::{Event, RowKind};
use super::types::{EpochSeal, EventKind, SealData, SealReport, SealSetup, VerifyBreak};

/// The key file's name in the data directory.
pub const KEY_FILE: &str = "seal.key";
/// The key file's one record, padded: overwritten in place, never resized.
const RECORD_LEN: usize = 256;
/// A public-key ledger's record (two keys and the setup's signature).
const RECORD_LEN_SIGNED: usize = 512;
/// The setup's `scheme` for public-key seals.
const ED25519: &str = "ed25519";
/// Seals written in one transaction when catching up many epochs.
const CATCH_UP_CHUNK: u64 = 1000;
/// The shortest interval `seal setup` accepts.
pub const MIN_INTERVAL: Duration = Duration::from_secs(1);
/// The form of the seals this build makes: 2, exports' trailers sealed too.
const SEAL_FORM: u32 = 2;

type HmacSha256 = Hmac<Sha256>;

/// The verification key: the seed `seal setup` printed (64 hex digits).
#[derive(Clone)]
pub struct SealKey([u8; 32]);

/// Key material is wiped when dropped: a core dump or a later reader of
/// this process's freed memory finds no epoch's key (best effort: copies
/// the compiler makes on the stack are not reached).
impl Drop for SealKey {
    fn drop(&mut self) {
        zeroize::Zeroize::zeroize(&mut self.0);
    }
}

impl std::fmt::Debug for SealKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("SealKey(..)")
    }
}

impl SealKey {
    /// Parses the key as `seal setup` printed it.
    pub fn parse(s: &str) -> Result<SealKey, String> {
        let bad =
            || "malformed seal key: expected the 64 hex digits `seal setup` printed".to_string();
        let bytes = hex::decode(s.trim()).map_err(|_| bad())?;
        let seed: [u8; 32] = bytes.try_into().map_err(|_| bad())?;
        Ok(SealKey(seed))
    }

    pub fn to_hex(&self) -> String {
        hex::encode(self.0)
    }

    /// key(0).
    fn first(&self) -> [u8; 32] {
        let mut h = Sha256::new();
        h.update(b"treewarden seal v1 key 0");
        h.update(self.0);
        h.finalize().into()
    }
}

/// key(n+1) from key(n).
fn evolve(key: &[u8; 32]) -> [u8; 32] {
    let mut h = Sha256::new();
    h.update(b"treewarden seal v1 next");
    h.update(key);
    h.finalize().into()
}

/// `hex(hmac_sha256(key, canonical(data without "mac")))`.
fn mac_of(key: &[u8; 32], data: &serde_json::Value) -> String {
    let mut data = data.clone();
    if let Some(obj) = data.as_object_mut() {
        obj.remove("mac");
    }
    let text = chain::canonical_string(&data);
    // HMAC takes a key of any length: this cannot fail.
    let mut mac = match <HmacSha256 as KeyInit>::new_from_slice(key) {
        Ok(mac) => mac,
        Err(_) => return String::new(),
    };
    mac.update(text.as_bytes());
    hex::encode(mac.finalize().into_bytes())
}

/// Constant-time enough for hex of equal length: a verifier's comparison.
fn same(a: &str, b: &str) -> bool {
    a.len() == b.len()
        && a.bytes()
            .zip(b.bytes())
            .fold(0u8, |acc, (x, y)| acc | (x ^ y))
            == 0
}

/// What a signature covers: the canonical JSON of the data without its
/// `mac` and `sig`.
fn message_of(data: &serde_json::Value) -> String {
    let mut data = data.clone();
    if let Some(obj) = data.as_object_mut() {
        obj.remove("mac");
        obj.remove("sig");
    }
    chain::canonical_string(&data)
}

fn sign_of(key: &[u8; 32], data: &serde_json::Value) -> String {
    hex::encode(
        SigningKey::from_bytes(key)
            .sign(message_of(data).as_bytes())
            .to_bytes(),
    )
}

fn signed_by(public: &VerifyingKey, data: &serde_json::Value, sig: Option<&str>) -> bool {
    let Some(sig) = sig
        .and_then(|s| hex::decode(s).ok())
        .and_then(|b| <[u8; 64]>::try_from(b).ok())
    else {
        return false;
    };
    public
        .verify(message_of(data).as_bytes(), &Signature::from_bytes(&sig))
        .is_ok()
}

fn public_of(key: &[u8; 32]) -> VerifyingKey {
    SigningKey::from_bytes(key).verifying_key()
}

fn parse_public(hex_text: &str) -> Option<VerifyingKey> {
    let bytes: [u8; 32] = hex::decode(hex_text.trim()).ok()?.try_into().ok()?;
    VerifyingKey::from_bytes(&bytes).ok()
}

/// The key of the epoch a sealer is in: an HMAC key (derived one way), or a
/// public-key ledger's signing key with the next epoch's, drawn already.
#[derive(Clone)]
enum EpochKey {
    Hmac([u8; 32]),
    Signing { key: [u8; 32], next: [u8; 32] },
}

impl Drop for EpochKey {
    fn drop(&mut self) {
        use zeroize::Zeroize;
        match self {
            EpochKey::Hmac(k) => k.zeroize(),
            EpochKey::Signing { key, next } => {
                key.zeroize();
                next.zeroize();
            }
        }
    }
}

impl EpochKey {
    /// The next epoch's key: derived (HMAC), or the drawn one, with a new
    /// one drawn after it.
    fn advance(&self) -> Result<EpochKey, LedgerError> {
        Ok(match self {
            EpochKey::Hmac(k) => EpochKey::Hmac(evolve(k)),
            EpochKey::Signing { next, .. } => EpochKey::Signing {
                key: *next,
                next: random_seed()?,
            },
        })
    }

    /// Adds the authenticator to `data` (an object): `mac`, or `sig`.
    fn authenticate(&self, data: &mut serde_json::Value) {
        let (field, value) = match self {
            EpochKey::Hmac(k) => ("mac", mac_of(k, data)),
            EpochKey::Signing { key, .. } => ("sig", sign_of(key, data)),
        };
        if let Some(obj) = data.as_object_mut() {
            obj.insert(field.into(), value.into());
        }
    }
}

fn to_value<T: serde::Serialize>(v: &T) -> Result<serde_json::Value, Fail> {
    serde_json::to_value(v).map_err(|e| LedgerError::Other(format!("seal: {e}")).into())
}

/// A setup's epoch clock, in milliseconds since the Unix epoch.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Clock {
    start_ms: i64,
    interval_ms: i64,
}

impl Clock {
    fn of(setup: &SealSetup) -> Option<Clock> {
        let start = humantime::parse_rfc3339(&setup.start).ok()?;
        let interval_ms = i64::try_from(setup.interval_ms).ok().filter(|i| *i > 0)?;
        Some(Clock {
            start_ms: ms(start),
            interval_ms,
        })
    }
    fn start_of(&self, epoch: u64) -> i64 {
        self.start_ms
            .saturating_add((epoch as i64).saturating_mul(self.interval_ms))
    }
    fn end_of(&self, epoch: u64) -> i64 {
        self.start_of(epoch.saturating_add(1))
    }
}

fn ms(t: SystemTime) -> i64 {
    t.duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
}

fn time_of(ms: i64) -> String {
    super::timestamp(SystemTime::UNIX_EPOCH + Duration::from_millis(u64::try_from(ms).unwrap_or(0)))
}

fn parse_ms(at: &str) -> Option<i64> {
    humantime::parse_rfc3339(at).ok().map(ms)
}

/// The setup event (seq, data), if sealing was set up.
pub(crate) fn read_setup(conn: &Connection) -> Result<Option<(i64, SealSetup)>, Fail> {
    let found: Option<(i64, String)> = conn
        .prepare_cached(
            "SELECT seq, data FROM events WHERE kind = 'ledger.seal'
             AND json_extract(data, '$.op') = 'setup' ORDER BY seq LIMIT 1",
        )?
        .query_row([], |r| Ok((r.get(0)?, r.get(1)?)))
        .optional()?;
    let Some((seq, text)) = found else {
        return Ok(None);
    };
    match serde_json::from_str::<SealData>(&text) {
        Ok(SealData::Setup(setup)) => Ok(Some((seq, setup))),
        _ => Err(LedgerError::Invariant(format!("seq {seq}: the seal setup is malformed")).into()),
    }
}

/// The newest seal's epoch, if any.
fn last_epoch(conn: &Connection) -> Result<Option<u64>, Fail> {
    let found: Option<String> = conn
        .prepare_cached(
            "SELECT data FROM events WHERE kind = 'ledger.seal'
             AND json_extract(data, '$.op') IN ('seal', 'close') ORDER BY seq DESC LIMIT 1",
        )?
        .query_row([], |r| r.get(0))
        .optional()?;
    Ok(match found.map(|t| serde_json::from_str::<SealData>(&t)) {
        Some(Ok(SealData::Seal(s) | SealData::Close(s))) => Some(s.epoch),
        None => None,
        Some(_) => {
            return Err(LedgerError::Invariant("the newest seal is malformed".into()).into());
        }
    })
}

/// The key file's record.
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
struct KeyRecord {
    /// The epoch whose key this is.
    epoch: u64,
    key: String,
    /// The setup's MAC (or signature): binds the file to one setup.
    setup: String,
    /// A public-key ledger's: the next epoch's key, drawn already.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    next: Option<String>,
}

impl Drop for KeyRecord {
    fn drop(&mut self) {
        use zeroize::Zeroize;
        self.key.zeroize();
        if let Some(next) = self.next.as_mut() {
            next.zeroize();
        }
    }
}

fn key_bytes(text: &str) -> Result<[u8; 32], LedgerError> {
    hex::decode(text)
        .ok()
        .and_then(|b| <[u8; 32]>::try_from(b).ok())
        .ok_or_else(|| LedgerError::Other("seal key file: the key is malformed".into()))
}

impl KeyRecord {
    fn of(epoch: u64, key: &EpochKey, setup: String) -> KeyRecord {
        let (key, next) = match key {
            EpochKey::Hmac(k) => (hex::encode(k), None),
            EpochKey::Signing { key, next } => (hex::encode(key), Some(hex::encode(next))),
        };
        KeyRecord {
            epoch,
            key,
            setup,
            next,
        }
    }
    fn key(&self) -> Result<EpochKey, LedgerError> {
        let key = key_bytes(&self.key)?;
        Ok(match &self.next {
            None => EpochKey::Hmac(key),
            Some(next) => EpochKey::Signing {
                key,
                next: key_bytes(next)?,
            },
        })
    }
    fn bytes(&self) -> Result<Vec<u8>, LedgerError> {
        let len = if self.next.is_some() {
            RECORD_LEN_SIGNED
        } else {
            RECORD_LEN
        };
        let mut text = serde_json::to_vec(self)
            .map_err(|e| LedgerError::Other(format!("seal key file: {e}")))?;
        if text.len() >= len {
            return Err(LedgerError::Other("seal key file: record too long".into()));
        }
        text.resize(len - 1, b' ');
        text.push(b'\n');
        Ok(text)
    }
}

/// The key file, open and locked (exclusive `flock`) for one sealer's run.
struct KeyFile {
    file: File,
    path: PathBuf,
    record: KeyRecord,
}

impl KeyFile {
    fn io(path: &Path, what: &str, e: std::io::Error) -> LedgerError {
        LedgerError::Other(format!("seal key file {}: {what}: {e}", path.display()))
    }

    fn open(path: &Path) -> Result<KeyFile, LedgerError> {
        let mut file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(path)
            .map_err(|e| Self::io(path, "cannot open", e))?;
        crate::proc::lock_exclusive(&file).map_err(|e| Self::io(path, "cannot lock", e))?;
        let mut text = String::new();
        file.read_to_string(&mut text)
            .map_err(|e| Self::io(path, "cannot read", e))?;
        let record: KeyRecord = serde_json::from_str(text.trim()).map_err(|e| {
            LedgerError::Other(format!("seal key file {}: malformed: {e}", path.display()))
        })?;
        Ok(KeyFile {
            file,
            path: path.to_path_buf(),
            record,
        })
    }

    /// Overwrites the record in place with the key of `epoch` and fsyncs.
    fn store(&mut self, epoch: u64, key: &EpochKey) -> Result<(), LedgerError> {
        let record = KeyRecord::of(epoch, key, self.record.setup.clone());
        crate::proc::write_all_at(&self.file, &record.bytes()?, 0)
            .map_err(|e| Self::io(&self.path, "cannot overwrite", e))?;
        self.file
            .sync_all()
            .map_err(|e| Self::io(&self.path, "cannot fsync", e))?;
        self.record = record;
        Ok(())
    }
}

/// The key file's path in `data_dir`.
pub fn key_path(data_dir: &Path) -> PathBuf {
    data_dir.join(KEY_FILE)
}

/// What `seal setup` made.
#[derive(Clone, Debug)]
pub struct SealSetupReport {
    /// The verification key (HMAC seals): print it once, keep it off the host.
    pub key: Option<SealKey>,
    /// The root public key (public-key seals), as 64 hex digits.
    pub public: Option<String>,
    pub seq: i64,
    pub start: String,
    pub interval: Duration,
    pub key_file: PathBuf,
}

/// What one sealer run did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SealRun {
    /// The epochs sealed (in order).
    pub sealed: Vec<u64>,
    /// How many of them were late.
    pub late: u64,
    /// The run ended with a `close` seal (of the last epoch in `sealed`).
    pub closed: bool,
    /// When the next epoch ends (the next seal is due).
    pub next_due: Option<SystemTime>,
}

fn random_seed() -> Result<[u8; 32], LedgerError> {
    let mut seed = [0u8; 32];
    File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut seed))
        .map_err(|e| LedgerError::Other(format!("seal setup: no random seed: {e}")))?;
    Ok(seed)
}

/// The setup's binding of the key file: its MAC, or its signature.
fn setup_id(setup: &SealSetup) -> &str {
    setup.sig.as_deref().unwrap_or(&setup.mac)
}

impl Ledger {
    /// `seal setup`: a new seed (or, with `public`, epoch 0's and epoch 1's
    /// signing keys), the key file (a new file, 0600, fsynced, holding
    /// epoch 0's key, and epoch 1's for public-key seals) and the setup
    /// event, committed FULL. Refused when sealing is already set up or the
    /// key file exists; a failed commit removes the key file.
    pub fn seal_setup(
        &self,
        data_dir: &Path,
        interval: Duration,
        public: bool,
    ) -> Result<SealSetupReport, LedgerError> {
        if interval < MIN_INTERVAL {
            return Err(LedgerError::Invariant(
                "seal interval: at least 1s".to_string(),
            ));
        }
        let interval_ms = u64::try_from(interval.as_millis())
            .map_err(|_| LedgerError::Invariant("seal interval too long".into()))?;
        if let Some((seq, _)) = self.read(|tx| read_setup(tx))? {
            return Err(LedgerError::Invariant(format!(
                "sealing is already set up (seq {seq})"
            )));
        }
        let path = key_path(data_dir);
        if path.symlink_metadata().is_ok() {
            return Err(LedgerError::Invariant(format!(
                "{} exists: sealing was set up before (or the file is another's)",
                path.display()
            )));
        }
        let (seed, key0) = if public {
            let key = random_seed()?;
            (
                None,
                EpochKey::Signing {
                    key,
                    next: random_seed()?,
                },
            )
        } else {
            let seed = SealKey(random_seed()?);
            let key0 = seed.first();
            (Some(seed), EpochKey::Hmac(key0))
        };
        let root = match &key0 {
            EpochKey::Signing { key, .. } => Some(hex::encode(public_of(key).to_bytes())),
            EpochKey::Hmac(_) => None,
        };
        let result = {
            let path = path.clone();
            let data_dir = data_dir.to_path_buf();
            let root = root.clone();
            self.write(Durability::Full, move |w| {
                if read_setup(w.tx)?.is_some() {
                    return Err(LedgerError::Invariant("sealing is already set up".into()).into());
                }
                let setup = SealSetup {
                    start: w.now.clone(),
                    interval_ms,
                    mac: String::new(),
                    scheme: root.as_ref().map(|_| ED25519.to_string()),
                    public: root,
                    sig: None,
                };
                let mut data = to_value(&SealData::Setup(setup))?;
                key0.authenticate(&mut data);
                let setup = match serde_json::from_value::<SealData>(data) {
                    Ok(SealData::Setup(setup)) => setup,
                    _ => {
                        return Err(
                            LedgerError::Other("seal setup: cannot be read back".into()).into()
                        );
                    }
                };
                let record = KeyRecord::of(0, &key0, setup_id(&setup).to_string());
                write_new_key_file(&path, &data_dir, &record)?;
                let seq = w.event(None, &Event::LedgerSeal(SealData::Setup(setup.clone())))?;
                Ok((seq, setup))
            })
        };
        match result {
            Ok((seq, setup)) => Ok(SealSetupReport {
                key: seed,
                public: setup.public,
                seq,
                start: setup.start,
                interval,
                key_file: path,
            }),
            Err(e) => {
                // The file did not exist before: if it does now, it is this
                // failed setup's, and must not outlive it.
                let _ = std::fs::remove_file(&path);
                Err(e)
            }
        }
    }

    /// Seals every ended epoch not sealed yet (late ones marked), and with
    /// `close` the current one too, as a clean stop. No setup: `Ok(None)`.
    pub fn seal_due(&self, data_dir: &Path, close: bool) -> Result<Option<SealRun>, LedgerError> {
        let Some((_, setup)) = self.read(|tx| read_setup(tx))? else {
            return Ok(None);
        };
        let clock = Clock::of(&setup)
            .ok_or_else(|| LedgerError::Invariant("the seal setup is malformed".into()))?;
        let mut keys = KeyFile::open(&key_path(data_dir))?;
        if !same(&keys.record.setup, setup_id(&setup)) {
            return Err(LedgerError::Invariant(format!(
                "seal key file {} belongs to another setup",
                keys.path.display()
            )));
        }
        let mut epoch = keys.record.epoch;
        let mut key = keys.record.key()?;
        // A public-key ledger seals one epoch a transaction: the key file
        // holds only the next epoch's key ahead.
        let chunk = match key {
            EpochKey::Hmac(_) => CATCH_UP_CHUNK,
            EpochKey::Signing { .. } => 1,
        };
        // A crash between a seal's commit and the key's overwrite: evolve
        // past the newest seal first.
        if let Some(last) = self.read(|tx| last_epoch(tx))?
            && last >= epoch
        {
            if chunk == 1 && last > epoch {
                return Err(LedgerError::Invariant(format!(
                    "seal key file {} holds epoch {epoch}'s key but the ledger is sealed to epoch {last}: the key of epoch {} is lost",
                    keys.path.display(),
                    last + 1
                )));
            }
            while epoch <= last {
                key = key.advance()?;
                epoch += 1;
            }
            keys.store(epoch, &key)?;
        }
        let mut run = SealRun::default();
        loop {
            let now = ms(SystemTime::now());
            if clock.end_of(epoch) > now {
                break;
            }
            // Seal the ended epochs from `epoch` on, a chunk per transaction.
            let (start_key, start_epoch) = (key.clone(), epoch);
            let sealed: Vec<(u64, bool)> = self.write(Durability::Full, move |w| {
                let now_ms = parse_ms(&w.now).unwrap_or(now);
                let (mut key, mut epoch) = (start_key, start_epoch);
                let mut out = Vec::new();
                while clock.end_of(epoch) <= now_ms && (out.len() as u64) < chunk {
                    let late = now_ms > clock.end_of(epoch) + clock.interval_ms;
                    append_seal(w, &key, epoch, late, false)?;
                    out.push((epoch, late));
                    epoch += 1;
                    if (out.len() as u64) < chunk {
                        key = key.advance()?;
                    }
                }
                Ok(out)
            })?;
            if !sealed.is_empty() {
                crate::testhook::crash_point("seal-committed");
            }
            for (e, late) in &sealed {
                key = key.advance()?;
                epoch = e + 1;
                run.sealed.push(*e);
                run.late += u64::from(*late);
            }
            // The old keys are gone from the file before these seals count.
            keys.store(epoch, &key)?;
            if sealed.is_empty() {
                break;
            }
        }
        if close {
            let (k, e) = (key.clone(), epoch);
            self.write(Durability::Full, move |w| {
                append_seal(w, &k, e, false, true)
            })?;
            key = key.advance()?;
            epoch += 1;
            keys.store(epoch, &key)?;
            run.sealed.push(epoch - 1);
            run.closed = true;
        }
        run.next_due = Some(
            SystemTime::UNIX_EPOCH
                + Duration::from_millis(u64::try_from(clock.end_of(epoch)).unwrap_or(0)),
        );
        Ok(Some(run))
    }

    /// Whether sealing is set up in this ledger: its setup (seq, interval).
    pub fn seal_setup_of(&self) -> Result<Option<(i64, Duration)>, LedgerError> {
        self.read(|tx| {
            Ok(read_setup(tx)?.map(|(seq, s)| (seq, Duration::from_millis(s.interval_ms))))
        })
    }
}

/// The key an export's trailer is sealed with: that of the epoch after the
/// ledger's newest seal, which the key file holds while that epoch is open.
pub(crate) struct TrailerKey {
    epoch: u64,
    key: EpochKey,
}

impl TrailerKey {
    /// Seals the trailer's object (`exported`'s value): adds `epoch`, then
    /// `mac` (or `sig`) over the canonical JSON of everything else in it.
    pub(crate) fn seal(&self, stamp: &mut serde_json::Value) {
        if let Some(obj) = stamp.as_object_mut() {
            obj.insert("epoch".into(), self.epoch.into());
        }
        self.key.authenticate(stamp);
    }
}

/// What a whole export of a sealed ledger starts from, all read under the
/// key file's lock (no seal commits meanwhile): the head it stops at, its
/// time, and its trailer's key.
pub(crate) struct ExportSeal {
    pub(crate) head: Option<(i64, String)>,
    pub(crate) at: SystemTime,
    pub(crate) key: TrailerKey,
}

impl Ledger {
    /// The start of a whole export of this ledger when it is sealed
    /// ([`ExportSeal`]); `Ok(None)` when it is not. The key file must be
    /// this setup's: an export of a sealed ledger whose trailer cannot be
    /// sealed is refused rather than written unauthenticated.
    pub(crate) fn export_seal(&self, data_dir: &Path) -> Result<Option<ExportSeal>, LedgerError> {
        let Some(lock) = self.seal_lock(data_dir)? else {
            return Ok(None);
        };
        let (head, last) = self.read(|tx| Ok((super::db::read_head(tx)?, last_epoch(tx)?)))?;
        let at = SystemTime::now();
        let key = lock.key_after(last)?;
        Ok(Some(ExportSeal { head, at, key }))
    }

    /// The key file, locked (no seal commits while it is held) and checked
    /// to be this setup's; `Ok(None)` when the ledger is not sealed.
    pub(crate) fn seal_lock(&self, data_dir: &Path) -> Result<Option<SealLock>, LedgerError> {
        let Some((_, setup)) = self.read(|tx| read_setup(tx))? else {
            return Ok(None);
        };
        let keys = KeyFile::open(&key_path(data_dir))?;
        if !same(&keys.record.setup, setup_id(&setup)) {
            return Err(LedgerError::Invariant(format!(
                "seal key file {} belongs to another setup",
                keys.path.display()
            )));
        }
        Ok(Some(SealLock { keys }))
    }
}

/// The key file held locked: no seal commits meanwhile.
pub(crate) struct SealLock {
    keys: KeyFile,
}

impl SealLock {
    /// The key of the epoch after `last` (the newest sealed epoch). A crash
    /// between a seal's commit and the key's overwrite leaves the file one
    /// epoch behind: the key after the newest seal is taken, as the next
    /// sealer will.
    pub(crate) fn key_after(&self, last: Option<u64>) -> Result<TrailerKey, LedgerError> {
        let want = last.map_or(0, |l| l + 1);
        let (mut epoch, mut key) = (self.keys.record.epoch, self.keys.record.key()?);
        while epoch < want {
            // A public-key ledger's file is at most one epoch behind (its
            // next key certified, drawn, and read here).
            if matches!(key, EpochKey::Signing { .. }) && epoch + 1 < want {
                return Err(LedgerError::Invariant(format!(
                    "seal key file holds epoch {epoch}'s key but the ledger is sealed to epoch {}",
                    want - 1
                )));
            }
            key = key.advance()?;
            epoch += 1;
        }
        Ok(TrailerKey { epoch, key })
    }
}

/// Stamps a backup just made (under `lock`, so its newest seal is the
/// ledger's): a `backup_stamp` table in the copy holding the stamp (its
/// time, host, machine, boot and head) sealed as an export's trailer is,
/// so that `verify` judges the copy's seals at the time it was taken.
pub(crate) fn stamp_backup(
    dest: &Path,
    lock: &SealLock,
    mut stamp: serde_json::Value,
) -> Result<(), LedgerError> {
    let fail = |e: rusqlite::Error| LedgerError::Other(format!("backup stamp: {e}"));
    let conn = Connection::open(dest).map_err(fail)?;
    let (head, last) =
        (|| -> Result<_, Fail> { Ok((super::db::read_head(&conn)?, last_epoch(&conn)?)) })()
            .map_err(|f| f.into_ledger(Duration::ZERO))?;
    let key = lock.key_after(last)?;
    if let Some(obj) = stamp.as_object_mut() {
        obj.insert(
            "head".into(),
            head.map(|(seq, hash)| serde_json::json!({"seq": seq, "hash": hash}))
                .unwrap_or_default(),
        );
    }
    key.seal(&mut stamp);
    conn.execute_batch("CREATE TABLE backup_stamp (stamp TEXT NOT NULL)")
        .map_err(fail)?;
    conn.execute(
        "INSERT INTO backup_stamp (stamp) VALUES (?1)",
        [chain::canonical_string(&stamp)],
    )
    .map_err(fail)?;
    Ok(())
}

/// A backup's stamp, if the ledger is one (`stamp_backup`).
pub(crate) fn read_backup_stamp(conn: &Connection) -> Result<Option<serde_json::Value>, Fail> {
    let has: Option<String> = conn
        .query_row(
            "SELECT name FROM sqlite_master WHERE type = 'table' AND name = 'backup_stamp'",
            [],
            |r| r.get(0),
        )
        .optional()?;
    if has.is_none() {
        return Ok(None);
    }
    let text: Option<String> = conn
        .query_row("SELECT stamp FROM backup_stamp LIMIT 1", [], |r| r.get(0))
        .optional()?;
    Ok(text.and_then(|t| serde_json::from_str(&t).ok()))
}

fn write_new_key_file(path: &Path, dir: &Path, record: &KeyRecord) -> Result<(), Fail> {
    use std::io::Write;
    let io = |what: &str, e: std::io::Error| -> Fail {
        LedgerError::Other(format!("seal key file {}: {what}: {e}", path.display())).into()
    };
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(path)
        .map_err(|e| io("cannot create", e))?;
    file.write_all(&record.bytes()?)
        .and_then(|()| file.sync_all())
        .map_err(|e| io("cannot write", e))?;
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(|e| io("cannot fsync its directory", e))?;
    Ok(())
}

/// Appends the seal (or close) of `epoch` over the current head.
fn append_seal(
    w: &mut super::db::Writer<'_>,
    key: &EpochKey,
    epoch: u64,
    late: bool,
    close: bool,
) -> Result<i64, Fail> {
    let (head_seq, head_hash) = w
        .head_now()?
        .unwrap_or_else(|| (0, chain::GENESIS.to_string()));
    let mut seal = EpochSeal {
        epoch,
        head_seq,
        head_hash,
        made_at: w.now.clone(),
        late,
        v: Some(SEAL_FORM),
        mac: String::new(),
        next: match key {
            EpochKey::Signing { next, .. } => Some(hex::encode(public_of(next).to_bytes())),
            EpochKey::Hmac(_) => None,
        },
        sig: None,
    };
    let wrap = |s: EpochSeal| {
        if close {
            SealData::Close(s)
        } else {
            SealData::Seal(s)
        }
    };
    let mut data = to_value(&wrap(seal.clone()))?;
    key.authenticate(&mut data);
    match key {
        EpochKey::Hmac(_) => seal.mac = data["mac"].as_str().unwrap_or_default().to_string(),
        EpochKey::Signing { .. } => seal.sig = data["sig"].as_str().map(str::to_string),
    }
    w.event(None, &Event::LedgerSeal(wrap(seal)))
}

/// The root public key `seal setup --pub` wrote (64 hex digits).
#[derive(Clone, Debug)]
pub struct SealPub(VerifyingKey);

impl SealPub {
    /// Parses the key as `seal setup --pub` wrote it.
    pub fn parse(s: &str) -> Result<SealPub, String> {
        parse_public(s).map(SealPub).ok_or_else(|| {
            "malformed public key: expected the 64 hex digits `seal setup --pub` wrote".to_string()
        })
    }
}

/// What `verify` checks seals with: the verification key (HMAC seals) or
/// the root public key (public-key seals).
#[derive(Clone, Debug)]
pub enum SealVerifier {
    Key(SealKey),
    Pub(SealPub),
}

/// The check's key state (one a verify run: its size does not matter).
#[allow(clippy::large_enum_variant)]
enum Checker {
    /// The seed, and the key of the next epoch expected.
    Hmac { seed: SealKey, key: [u8; 32] },
    /// The root, the public key of the next epoch expected (certified by
    /// the seal before it), the sealed epochs' public keys, and the data
    /// dir to look through for their private keys (a ledger's, not an
    /// export's).
    Signed {
        root: VerifyingKey,
        current: VerifyingKey,
        sealed: Vec<(u64, [u8; 32])>,
        dir: Option<PathBuf>,
    },
}

/// `verify --seal-key` / `--seal-pub`: fed every event in seq order by the chain walk.
pub(crate) struct SealCheck {
    check: Checker,
    setup: Option<(i64, SealSetup, Clock)>,
    /// The next epoch expected (its key in `check`).
    next: u64,
    seals: u64,
    late: u64,
    first_late: Option<u64>,
    last: Option<(u64, i64, String, bool, i64)>,
    /// Events walked since the newest seal.
    since_last: u64,
    events: u64,
    /// A seal of form 2 was walked: the export's trailer must be sealed.
    binds_trailers: bool,
}

impl SealCheck {
    /// `dir`: the data dir of the ledger checked (none for an export).
    pub(crate) fn new(verifier: SealVerifier, dir: Option<PathBuf>) -> SealCheck {
        let check = match verifier {
            SealVerifier::Key(seed) => Checker::Hmac {
                key: seed.first(),
                seed,
            },
            SealVerifier::Pub(SealPub(root)) => Checker::Signed {
                root,
                current: root,
                sealed: Vec::new(),
                dir,
            },
        };
        SealCheck {
            check,
            setup: None,
            next: 0,
            seals: 0,
            late: 0,
            first_late: None,
            last: None,
            since_last: 0,
            events: 0,
            binds_trailers: false,
        }
    }

    fn broke(seq: i64, what: String) -> Option<VerifyBreak> {
        Some(VerifyBreak {
            seq: Some(seq),
            what,
        })
    }

    /// One event of the chain (already proven to hash right).
    // Over 100 lines on purpose: the seal rules for one event (epoch order, the seal's MAC, the
    // key's evolution) in the order they are checked, which is the contract.
    pub(crate) fn step(
        &mut self,
        seq: i64,
        kind: &RowKind,
        data: &serde_json::Value,
        prev_hash: &str,
    ) -> Option<VerifyBreak> {
        self.events += 1;
        self.since_last += 1;
        if *kind != EventKind::LedgerSeal {
            return None;
        }
        let parsed: SealData = match serde_json::from_value(data.clone()) {
            Ok(p) => p,
            Err(e) => return Self::broke(seq, format!("ledger.seal data is malformed: {e}")),
        };
        let (seal, close) = match parsed {
            SealData::Setup(setup) => {
                if let Some((at, _, _)) = &self.setup {
                    return Self::broke(
                        seq,
                        format!(
                            "a second seal setup (the first is seq {at}): sealing was set up again"
                        ),
                    );
                }
                if let Some(what) = self.setup_refused(data, &setup) {
                    return Self::broke(seq, what);
                }
                let Some(clock) = Clock::of(&setup) else {
                    return Self::broke(seq, "the seal setup is malformed".into());
                };
                self.setup = Some((seq, setup, clock));
                return None;
            }
            SealData::Seal(s) => (s, false),
            SealData::Close(s) => (s, true),
        };
        let Some((_, _, clock)) = &self.setup else {
            return Self::broke(
                seq,
                format!("epoch {}: a seal with no seal setup before it", seal.epoch),
            );
        };
        let clock = *clock;
        let epoch = seal.epoch;
        if epoch < self.next {
            return Self::broke(
                seq,
                format!(
                    "epoch {epoch}: sealed again or out of order (epoch {} was sealed before it): seals reordered or replayed",
                    self.next - 1
                ),
            );
        }
        if epoch > self.next {
            return Self::broke(
                seq,
                format!(
                    "epochs {} to {} are not sealed ({} to {}; the next seal is epoch {epoch}): seals stripped, or the ledger truncated and continued",
                    self.next,
                    epoch - 1,
                    time_of(clock.start_of(self.next)),
                    time_of(clock.end_of(epoch - 1)),
                ),
            );
        }
        match &self.check {
            Checker::Hmac { key, .. } if !same(&mac_of(key, data), &seal.mac) => {
                return Self::broke(
                    seq,
                    format!(
                        "epoch {epoch}: the seal's MAC does not match its epoch's key (made with another key, e.g. a later one, or edited)"
                    ),
                );
            }
            Checker::Signed { current, .. } if !signed_by(current, data, seal.sig.as_deref()) => {
                return Self::broke(
                    seq,
                    format!(
                        "epoch {epoch}: the seal's signature does not match its epoch's public key (made with another key, e.g. a later epoch's found on the host, or edited)"
                    ),
                );
            }
            _ => {}
        }
        let next_public = match &self.check {
            Checker::Signed { .. } => match seal.next.as_deref().and_then(parse_public) {
                Some(next) => Some(next),
                None => {
                    return Self::broke(
                        seq,
                        format!("epoch {epoch}: the seal certifies no next public key"),
                    );
                }
            },
            Checker::Hmac { .. } => None,
        };
        if seal.head_seq != seq - 1 || seal.head_hash != prev_hash {
            return Self::broke(
                seq,
                format!(
                    "epoch {epoch}: the sealed head {}:{} is not this chain's (events at or below seq {} were edited, removed or reordered and the chain recomputed)",
                    seal.head_seq, seal.head_hash, seal.head_seq
                ),
            );
        }
        let Some(made) = parse_ms(&seal.made_at) else {
            return Self::broke(seq, format!("epoch {epoch}: the seal's time is malformed"));
        };
        if !close && made < clock.end_of(epoch) {
            return Self::broke(seq, format!("epoch {epoch}: sealed before the epoch ended"));
        }
        let late = made > clock.end_of(epoch) + clock.interval_ms;
        if late {
            self.late += 1;
            self.first_late.get_or_insert(epoch);
        }
        self.binds_trailers |= seal.v.unwrap_or(1) >= SEAL_FORM;
        self.seals += 1;
        self.next = epoch + 1;
        match (&mut self.check, next_public) {
            (Checker::Hmac { key, .. }, _) => *key = evolve(key),
            (
                Checker::Signed {
                    current, sealed, ..
                },
                Some(next),
            ) => {
                sealed.push((epoch, current.to_bytes()));
                *current = next;
            }
            (Checker::Signed { .. }, None) => {}
        }
        self.last = Some((epoch, seq, seal.made_at, close, made));
        self.since_last = 0;
        None
    }

    /// Why the setup is not the one this check's key or root belongs to.
    fn setup_refused(&self, data: &serde_json::Value, setup: &SealSetup) -> Option<String> {
        let signed = setup.scheme.is_some();
        match &self.check {
            Checker::Hmac { .. } if signed => Some(format!(
                "this ledger's seals are signed ({}): check them with --seal-pub FILE, the root public key `seal setup --pub` wrote",
                setup.scheme.as_deref().unwrap_or_default()
            )),
            Checker::Hmac { seed, .. } => (!same(&mac_of(&seed.first(), data), &setup.mac)).then(|| {
                "the seal key does not match this ledger's seal setup (wrong key, or the setup was replaced)".to_string()
            }),
            Checker::Signed { .. } if setup.scheme.as_deref() != Some(ED25519) => Some(
                "this ledger's seals are HMACs: check them with --seal-key KEY, the verification key `seal setup` printed".into(),
            ),
            Checker::Signed { root, .. } => {
                if setup.public.as_deref().and_then(parse_public) != Some(*root) {
                    Some("the public key does not match this ledger's seal setup (wrong key, or the setup was replaced)".into())
                } else if !signed_by(root, data, setup.sig.as_deref()) {
                    Some("the seal setup's signature does not match its public key (edited)".into())
                } else {
                    None
                }
            }
        }
    }

    /// An export's trailer (the `exported` object, on `line`), after the
    /// walk: sealed with the key the export's newest seal handed on, which
    /// binds its time, host, head, filter and count. Returns what it proves.
    pub(crate) fn check_trailer(
        &self,
        line: usize,
        stamp: &serde_json::Value,
    ) -> Result<String, VerifyBreak> {
        let fail = |what: String| {
            Err(VerifyBreak {
                seq: None,
                what: format!("line {line}: {what}"),
            })
        };
        let epoch = stamp.get("epoch").and_then(serde_json::Value::as_u64);
        let mac = stamp.get("mac").and_then(serde_json::Value::as_str);
        let sig = stamp.get("sig").and_then(serde_json::Value::as_str);
        let (Some(epoch), true) = (epoch, mac.is_some() || sig.is_some()) else {
            if self.binds_trailers {
                return fail("the trailer carries no seal (epoch and MAC), but this ledger's seals bind every export's trailer: written by hand or by another tool".into());
            }
            return Ok("the trailer is unauthenticated (an export made before trailers were sealed: a cut export with a hand-written last line would pass)".into());
        };
        if epoch != self.next {
            return fail(format!(
                "the trailer is sealed as epoch {epoch}, but the export's seals hand on epoch {}'s key: the export was cut before its newest seals, or the trailer is another export's",
                self.next
            ));
        }
        if !self.sealed_now(stamp) {
            let what = match self.check {
                Checker::Hmac { .. } => "MAC does not match epoch",
                Checker::Signed { .. } => "signature does not match epoch",
            };
            return fail(format!(
                "the trailer's {what} {epoch}'s key: its time, host, machine id, boot id, head, filter or event count was edited, or it was written by hand"
            ));
        }
        Ok(format!(
            "the trailer (time, host, head, count) is sealed with epoch {epoch}'s key"
        ))
    }

    /// Whether `stamp` (a trailer, a backup's stamp) carries its MAC or
    /// signature by the key the newest seal handed on.
    fn sealed_now(&self, stamp: &serde_json::Value) -> bool {
        let field = |name| stamp.get(name).and_then(serde_json::Value::as_str);
        match &self.check {
            Checker::Hmac { key, .. } => field("mac").is_some_and(|m| same(&mac_of(key, stamp), m)),
            Checker::Signed { current, .. } => signed_by(current, stamp, field("sig")),
        }
    }

    /// A backup's stamp (`stamp_backup`), after the walk: sealed with the
    /// key the copy's newest seal handed on. Returns its epoch.
    pub(crate) fn check_backup_stamp(&self, stamp: &serde_json::Value) -> Result<u64, VerifyBreak> {
        let fail = |what: String| {
            Err(VerifyBreak {
                seq: None,
                what: format!("the backup's stamp {what}"),
            })
        };
        let Some(epoch) = stamp.get("epoch").and_then(serde_json::Value::as_u64) else {
            return fail("carries no seal (edited, or written by hand)".into());
        };
        if epoch != self.next {
            return fail(format!(
                "is sealed as epoch {epoch}, but the copy's seals hand on epoch {}'s key: the copy was cut, or the stamp is another copy's",
                self.next
            ));
        }
        if !self.sealed_now(stamp) {
            return fail(format!(
                "does not match epoch {epoch}'s key: its time, host, machine id, boot id or head was edited"
            ));
        }
        Ok(epoch)
    }

    /// After the walk: seals exist, and the newest is fresh at `read_at`
    /// (or a clean close).
    /// `read_at`: `None` for an export without its own time, which
    /// fails here unless the newest seal is a close.
    pub(crate) fn finish(self, read_at: Option<SystemTime>) -> Result<SealReport, VerifyBreak> {
        let Some((setup_seq, setup, clock)) = self.setup.clone() else {
            return Err(VerifyBreak {
                seq: None,
                what: "the ledger has no seal setup: the seal key matches no seal".into(),
            });
        };
        if let Checker::Signed {
            sealed,
            dir: Some(dir),
            ..
        } = &self.check
            && let Some((file, epoch)) = erased_key_left(dir, sealed)
        {
            return Err(VerifyBreak {
                seq: None,
                what: format!(
                    "epoch {epoch}'s private key is still on disk, in {}: its seal should have erased it (a copy of the key file, or an overwrite that did not happen)",
                    file.display()
                ),
            });
        }
        let Some((epoch, seq, made_at, closed, made_ms)) = self.last.clone() else {
            return Err(VerifyBreak {
                seq: Some(setup_seq),
                what: format!(
                    "sealing was set up ({}, interval {}) but the ledger holds no seal (stripped, or epoch 0 has not been sealed yet; its seal is due at {})",
                    setup.start,
                    humantime::format_duration(Duration::from_millis(setup.interval_ms)),
                    time_of(clock.end_of(0))
                ),
            });
        };
        let read_ms = read_at.map(ms);
        if closed {
            // The writer stopped cleanly: no fresher seal is asked for.
            return Ok(self.report(setup_seq, &setup, epoch, seq, made_at, closed, read_ms));
        }
        let Some(read_ms) = read_ms else {
            return Err(VerifyBreak {
                seq: None,
                what: "the export carries no time of its own (no `exported` last line, as `treewarden export` writes for a sealed ledger): the newest seal's freshness cannot be judged".into(),
            });
        };
        // The newest seal may be two intervals old at most, counted from
        // when it was made (MACed): the next one is due one interval after
        // it, and one more is allowed for a busy sealer. Older is stale.
        let due = made_ms + 2 * clock.interval_ms;
        if read_ms > due {
            return Err(VerifyBreak {
                seq: Some(seq),
                what: format!(
                    "epoch {}: not sealed, and overdue since {} (read at {}; the newest seal is epoch {epoch}, made {made_at}): seals stripped, the ledger truncated, or the sealer stopped without `seal close`",
                    epoch + 1,
                    time_of(due),
                    time_of(read_ms),
                ),
            });
        }
        Ok(self.report(
            setup_seq,
            &setup,
            epoch,
            seq,
            made_at,
            closed,
            Some(read_ms),
        ))
    }

    #[allow(clippy::too_many_arguments)]
    fn report(
        &self,
        setup_seq: i64,
        setup: &SealSetup,
        epoch: u64,
        seq: i64,
        made_at: String,
        closed: bool,
        read_ms: Option<i64>,
    ) -> SealReport {
        SealReport {
            setup_seq,
            interval_ms: setup.interval_ms,
            seals: self.seals,
            last_epoch: epoch,
            last_seq: seq,
            last_made_at: made_at,
            closed,
            late: self.late,
            first_late: self.first_late,
            // The events after the newest seal, not the seal itself.
            unsealed: self.since_last,
            read_at: read_ms.map(time_of),
        }
    }
}

/// Files this large are not looked through for keys (a key file is 512 bytes).
const SCAN_MAX: u64 = 1 << 20;

/// The first file under `dir` that holds, as 64 hex digits, the private key
/// of a sealed epoch (one of `sealed`'s public keys): (file, epoch). The
/// ledger's own files are skipped: no key is ever written to SQLite.
fn erased_key_left(dir: &Path, sealed: &[(u64, [u8; 32])]) -> Option<(PathBuf, u64)> {
    let by_public: std::collections::HashMap<[u8; 32], u64> =
        sealed.iter().map(|(e, p)| (*p, *e)).collect();
    let mut stack = vec![(dir.to_path_buf(), 0u32)];
    while let Some((d, depth)) = stack.pop() {
        let Ok(entries) = std::fs::read_dir(&d) else {
            continue;
        };
        for entry in entries.flatten() {
            let path = entry.path();
            let Ok(meta) = std::fs::symlink_metadata(&path) else {
                continue;
            };
            let name = entry.file_name();
            if meta.is_dir() && depth < 4 {
                stack.push((path, depth + 1));
                continue;
            }
            if !meta.is_file()
                || meta.len() > SCAN_MAX
                || name.to_string_lossy().starts_with("ledger.db")
            {
                continue;
            }
            let Ok(bytes) = std::fs::read(&path) else {
                continue;
            };
            for run in bytes.split(|b| !b.is_ascii_hexdigit()) {
                let Some(key) = (run.len() == 64)
                    .then(|| std::str::from_utf8(run).ok())
                    .flatten()
                    .and_then(|t| key_bytes(t).ok())
                else {
                    continue;
                };
                if let Some(epoch) = by_public.get(&public_of(&key).to_bytes()) {
                    return Some((path, *epoch));
                }
            }
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_evolve_one_way_and_differ_per_epoch() {
        let seed = SealKey([7; 32]);
        let k0 = seed.first();
        let k1 = evolve(&k0);
        assert_ne!(k0, k1);
        assert_ne!(evolve(&k1), k1);
        let data = serde_json::json!({"op": "seal", "epoch": 3, "mac": "x"});
        assert_ne!(mac_of(&k0, &data), mac_of(&k1, &data));
        // The mac field itself is not covered.
        let other = serde_json::json!({"op": "seal", "epoch": 3, "mac": "y"});
        assert_eq!(mac_of(&k0, &data), mac_of(&k0, &other));
    }

    #[test]
    fn the_key_parses_as_printed() {
        let seed = SealKey([0xab; 32]);
        let back = SealKey::parse(&seed.to_hex()).expect("parses");
        assert_eq!(back.0, seed.0);
        assert!(SealKey::parse("abc").is_err());
    }
}
