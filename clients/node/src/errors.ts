/**
 * Errors, named for what the caller does next. Every failure of the
 * service arrives as a JSON body `{"error": ..., "code": ...}`; the class is
 * chosen by `code`, never by the HTTP status alone (a 503 is a closed
 * dispatch, which waits for an operator, or a busy service, which a retry
 * outlives). A 413 is its own class: the request was too big to be read.
 */

/** Any failure of treewarden itself (never the workload's own exit). */
export class TreewardenError extends Error {
  /** The server's `code` (`undefined` when the failure is the client's). */
  readonly code: string | undefined;
  /** The HTTP status, when there was an answer. */
  readonly status: number | undefined;
  /** The tree the error names, when it names one. */
  readonly tree: number | undefined;

  constructor(message: string, opts: { code?: string; status?: number; tree?: number; cause?: unknown } = {}) {
    super(message, opts.cause === undefined ? undefined : { cause: opts.cause });
    this.name = new.target.name;
    this.code = opts.code;
    this.status = opts.status;
    this.tree = opts.tree;
  }
}

/** A tree in your scope is unsettled: an operator must act. Do not retry in a loop. */
export class DispatchClosed extends TreewardenError {}
/** A teardown could not prove its authority: survivors were left alive as evidence. */
export class Ambiguous extends TreewardenError {}
/** The principal may not do this. */
export class Forbidden extends TreewardenError {}
/** No such tree (or endpoint). */
export class NotFound extends TreewardenError {}
/** The request itself is wrong; the message is the server's. */
export class BadRequest extends TreewardenError {}
/** 413: the request's body is over the service's limit (1 MiB): a huge argv or env. */
export class PayloadTooLarge extends BadRequest {}
/** Not now: draining, busy, or a bound of yours reached. Retried by the client, then raised. */
export class Unavailable extends TreewardenError {}
/** No token, a wrong one, or a revoked one (TCP). */
export class Unauthorized extends TreewardenError {}
/** The tree's state does not allow it. */
export class Conflict extends TreewardenError {}
/** The service failed (500); the detail is in its log. */
export class ServiceError extends TreewardenError {}
/** The service could not be reached, or the connection failed before an answer. */
export class ConnectionFailed extends TreewardenError {}

const BY_CODE: Record<string, new (m: string, o: { code?: string; status?: number; tree?: number }) => TreewardenError> = {
  DispatchClosed,
  Ambiguous,
  Forbidden,
  NotFound,
  BadRequest,
  Unavailable,
  Unauthorized,
  Conflict,
  Internal: ServiceError,
};

/** The error for an answer of `status` with `body` (parsed JSON, or text). */
export function fromBody(status: number, body: unknown): TreewardenError {
  let message = `HTTP ${status}`;
  let code: string | undefined;
  let tree: number | undefined;
  if (body !== null && typeof body === 'object') {
    const b = body as Record<string, unknown>;
    if (typeof b.error === 'string' && b.error) message = b.error;
    if (typeof b.code === 'string') code = b.code;
    if (typeof b.tree === 'number') tree = b.tree;
  } else if (typeof body === 'string' && body.trim()) {
    message = body.trim();
  }
  const opts = { code, status, tree };
  if (status === 413) return new PayloadTooLarge(message, opts);
  const cls = code === undefined ? undefined : BY_CODE[code];
  if (cls) return new cls(message, opts);
  // No code to go by (something in front of the service): a 503 is still "not now".
  return status === 503 ? new Unavailable(message, opts) : new TreewardenError(message, opts);
}
