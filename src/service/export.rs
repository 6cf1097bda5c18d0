//! Streaming exports for the HTTP API: the ledger's pages go to the client
//! through a small bounded channel, so the service's memory does not grow
//! with the ledger (it is never built whole in memory).

use tokio::sync::{mpsc, oneshot};

use super::{Service, ServiceError};
use crate::ledger::{EventFilter, ExportFormat, LedgerError};

/// Pages in flight between the ledger and a slow client.
const IN_FLIGHT: usize = 2;

/// The chunks of one export; an `Err` ends it early (the response body is
/// cut, which the client sees as an incomplete transfer).
pub type ExportChunks = mpsc::Receiver<Result<Vec<u8>, std::io::Error>>;

impl Service {
    /// Starts an export on the blocking pool and returns its chunks once the
    /// first page is read: a ledger that cannot be read is an error status,
    /// not a cut body. The reader blocks while the client is slow (at most
    /// [`IN_FLIGHT`] pages are buffered) and stops when the client goes away.
    pub async fn export_stream(
        &self,
        filter: EventFilter,
        format: ExportFormat,
    ) -> Result<ExportChunks, ServiceError> {
        let (tx, rx) = mpsc::channel(IN_FLIGHT);
        let (started_tx, started_rx) = oneshot::channel::<Result<(), LedgerError>>();
        let engine = self.engine.clone();
        tokio::task::spawn_blocking(move || {
            let mut started = Some(started_tx);
            let result = engine.ledger().export_with(&filter, format, &mut |bytes| {
                if let Some(s) = started.take() {
                    let _ = s.send(Ok(()));
                }
                tx.blocking_send(Ok(bytes.to_vec()))
                    .map_err(|_| LedgerError::Other("export: the client went away".into()))
            });
            match (result, started.take()) {
                // Nothing to write (an OCSF view of events none of which
                // is process activity): an empty body.
                (Ok(_), Some(s)) => {
                    let _ = s.send(Ok(()));
                }
                (Ok(_), None) => {}
                (Err(e), Some(s)) => {
                    let _ = s.send(Err(e));
                }
                (Err(e), None) => {
                    tracing::warn!(error = %e, "export cut short");
                    let _ = tx.blocking_send(Err(std::io::Error::other(e.to_string())));
                }
            }
        });
        match started_rx.await {
            Ok(Ok(())) => Ok(rx),
            Ok(Err(e)) => Err(e.into()),
            Err(e) => Err(ServiceError::Task(e.to_string())),
        }
    }
}
