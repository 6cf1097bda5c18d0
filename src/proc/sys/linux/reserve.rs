//! Room held on a filesystem ahead of need: blocks allocated past a file's
//! end (`fallocate` with `KEEP_SIZE`), its length unchanged.

/// Whether [`reserve_past_end`] can hold room here (Linux: yes).
pub const RESERVES_PAST_END: bool = true;

/// Allocates `bytes` of `file` from its start, past its end where it is
/// shorter (`fallocate` with `KEEP_SIZE`): its next appends need no new
/// blocks, and its length stays what it was.
pub fn reserve_past_end(file: &std::fs::File, bytes: u64) -> std::io::Result<()> {
    use rustix::fs::FallocateFlags as F;
    rustix::fs::fallocate(file, F::KEEP_SIZE, 0, bytes).map_err(Into::into)
}
