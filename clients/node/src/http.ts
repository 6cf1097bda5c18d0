/**
 * HTTP/1.1 to the service, over its Unix socket or loopback TCP with a
 * token. One connection per request (`Connection: close`, no agent), as the
 * Python client does.
 *
 * A client holds at most `maxConcurrent` connections at once and queues
 * the rest, well under the service's per-user connection cap (64 by
 * default): past the cap the service answers 503 and closes, which Node
 * sees as `EPIPE`/`ECONNRESET` when it is still writing. A 503 whose code
 * is `Unavailable` (or that has no code) is retried after its
 * `Retry-After` (bounded), a few times; `DispatchClosed` never is. A body
 * over 64 KiB is sent after `Expect: 100-continue`, so a 413 is read as
 * such instead of a broken pipe.
 */

import * as http from 'node:http';
import { setTimeout as sleep } from 'node:timers/promises';

import { ConnectionFailed, TreewardenError, Unavailable, fromBody } from './errors.js';

/** Where the service answers. */
export interface Endpoint {
  /** The Unix socket's path. */
  socketPath?: string;
  /** `http://HOST:PORT` (TCP; a token is needed). */
  url?: string;
  /** The bearer token (TCP). */
  token?: string;
}

export interface TransportOptions {
  /** Connections held at once by this client's calls (default 16); more queue. */
  maxConcurrent?: number;
  /** Connections held at once by its long polls (waits; default 16); more queue. */
  maxWaits?: number;
  /** Retries of a 503 `Unavailable` (default 8). */
  retries?: number;
  /** The longest pause before a retry, in ms (default 1000). */
  maxRetryDelayMs?: number;
  /** A request's bound in ms (default 120 000). */
  timeoutMs?: number;
}

export interface Answer {
  status: number;
  headers: http.IncomingHttpHeaders;
  body: Buffer;
}

/** A connection upgraded by the service's `101`. */
export interface Upgraded {
  headers: http.IncomingHttpHeaders;
  socket: import('node:net').Socket;
  /** Bytes of the upgraded stream that came with the answer. */
  head: Buffer;
}

export interface RequestOptions {
  body?: unknown;
  timeoutMs?: number;
  /** Send nothing more and give up when it aborts (the request may have been served). */
  signal?: AbortSignal;
  /** A long poll (a wait): it takes a connection of the waits' own share. */
  long?: boolean;
  /** Given the request's socket, e.g. to `unref()` it. */
  onSocket?: (socket: import('node:net').Socket) => void;
}

/** Bodies bigger than this wait for `100 Continue` before they are sent. */
const EXPECT_OVER = 64 * 1024;

/** A counting semaphore: at most `n` holders, the rest in order. */
class Slots {
  private free: number;
  private readonly queue: Array<() => void> = [];
  constructor(n: number) {
    this.free = Math.max(1, n);
  }
  get waiting(): number {
    return this.queue.length;
  }
  async take(): Promise<void> {
    if (this.free > 0) {
      this.free -= 1;
      return;
    }
    await new Promise<void>((resolve) => this.queue.push(resolve));
  }
  give(): void {
    const next = this.queue.shift();
    if (next) next();
    else this.free += 1;
  }
}

export class Transport {
  readonly unix: boolean;
  private readonly target: { socketPath?: string; host?: string; port?: number; base: string };
  private readonly token: string | undefined;
  private readonly slots: Slots;
  private readonly waitSlots: Slots;
  private readonly retries: number;
  private readonly maxRetryDelayMs: number;
  private readonly timeoutMs: number;
  /** 503s retried so far (for tests and metrics). */
  retried = 0;

  constructor(ep: Endpoint, opts: TransportOptions = {}) {
    if (ep.url !== undefined) {
      const u = new URL(ep.url);
      if (u.protocol !== 'http:' || !u.hostname) throw new TypeError(`url must be http://HOST:PORT, not ${ep.url}`);
      this.target = {
        host: u.hostname.replace(/^\[|\]$/g, ''),
        port: u.port ? Number(u.port) : 80,
        base: u.pathname.replace(/\/$/, ''),
      };
      this.unix = false;
    } else {
      if (!ep.socketPath) throw new TypeError('a socketPath or a url is needed');
      this.target = { socketPath: ep.socketPath, base: '' };
      this.unix = true;
    }
    this.token = ep.token;
    this.slots = new Slots(opts.maxConcurrent ?? 16);
    this.waitSlots = new Slots(opts.maxWaits ?? 16);
    this.retries = opts.retries ?? 8;
    this.maxRetryDelayMs = opts.maxRetryDelayMs ?? 1000;
    this.timeoutMs = opts.timeoutMs ?? 120_000;
  }

  /** Long polls queued for a connection right now (a wait shortens its poll then). */
  get waitsQueued(): number {
    return this.waitSlots.waiting;
  }

  /** One request; an error answer throws (by its `code`). */
  async request(method: string, path: string, opts: RequestOptions = {}): Promise<Answer> {
    for (let attempt = 0; ; attempt++) {
      let a: Answer;
      const slots = opts.long ? this.waitSlots : this.slots;
      await slots.take();
      try {
        a = await this.once(method, path, opts);
      } finally {
        slots.give();
      }
      if (a.status < 300) return a;
      const err = fromBody(a.status, parse(a.body));
      if (!(err instanceof Unavailable) || attempt >= this.retries || opts.signal?.aborted) throw err;
      this.retried += 1;
      const after = Number(a.headers['retry-after']);
      const backoff = Math.min(this.maxRetryDelayMs, 25 * 2 ** attempt);
      const wait = Number.isFinite(after) && after > 0 ? Math.min(this.maxRetryDelayMs, after * 1000) : backoff;
      // Jitter, so the refused callers do not come back in one burst.
      await sleep(wait / 2 + Math.random() * (wait / 2));
    }
  }

  private once(method: string, path: string, opts: RequestOptions & { upgrade: string }): Promise<Answer | Upgraded>;
  private once(method: string, path: string, opts: RequestOptions): Promise<Answer>;
  private once(method: string, path: string, opts: RequestOptions & { upgrade?: string }): Promise<Answer | Upgraded> {
    const payload = opts.body === undefined ? undefined : Buffer.from(JSON.stringify(opts.body), 'utf8');
    const headers: http.OutgoingHttpHeaders = {
      Host: this.unix ? 'localhost' : `${this.target.host}:${this.target.port}`,
      Connection: opts.upgrade ? 'Upgrade' : 'close',
      'User-Agent': 'treewarden-node/0.1',
    };
    if (opts.upgrade) headers.Upgrade = opts.upgrade;
    if (this.token) headers.Authorization = `Bearer ${this.token}`;
    if (payload) {
      headers['Content-Type'] = 'application/json';
      headers['Content-Length'] = payload.length;
    }
    const expect = payload !== undefined && payload.length > EXPECT_OVER;
    if (expect) headers.Expect = '100-continue';
    const limit = opts.timeoutMs ?? this.timeoutMs;
    const where = this.unix ? this.target.socketPath : `${this.target.host}:${this.target.port}`;
    return new Promise<Answer | Upgraded>((resolve, reject) => {
      let settled = false;
      const fail = (e: unknown): void => {
        if (settled) return;
        settled = true;
        const err = e as NodeJS.ErrnoException;
        reject(
          e instanceof TreewardenError
            ? e
            : new ConnectionFailed(`${method} ${path}: treewarden at ${where}: ${err?.code ?? ''} ${err?.message ?? e}`.trim(), { cause: e }),
        );
      };
      const req = http.request(
        {
          method,
          path: this.target.base + path,
          socketPath: this.target.socketPath,
          host: this.target.host,
          port: this.target.port,
          headers,
          agent: false,
          timeout: limit,
          signal: opts.signal,
        },
        (res) => {
          const chunks: Buffer[] = [];
          res.on('data', (c: Buffer) => chunks.push(c));
          res.on('error', fail);
          res.on('end', () => {
            if (settled) return;
            settled = true;
            resolve({ status: res.statusCode ?? 0, headers: res.headers, body: Buffer.concat(chunks) });
          });
        },
      );
      if (opts.upgrade) {
        req.on('upgrade', (res, socket, head) => {
          if (settled) {
            socket.destroy();
            return;
          }
          settled = true;
          socket.setTimeout(0);
          resolve({ headers: res.headers, socket, head });
        });
      }
      if (opts.onSocket) req.on('socket', opts.onSocket);
      req.on('timeout', () => req.destroy(new ConnectionFailed(`${method} ${path}: no answer in ${limit} ms`)));
      req.on('error', fail);
      if (expect) {
        req.on('continue', () => req.end(payload));
      } else {
        req.end(payload);
      }
    });
  }

  /**
   * A request answered `101` with the connection upgraded to `protocol`
   * (streamed stdio): the socket, and what of its bytes came with the
   * answer. Any other answer throws as `request` does (a 503 `Unavailable`
   * is retried); the connection's slot is held only until the answer.
   */
  async upgrade(method: string, path: string, protocol: string, opts: RequestOptions = {}): Promise<Upgraded> {
    for (let attempt = 0; ; attempt++) {
      await this.slots.take();
      let a: Answer | Upgraded;
      try {
        a = await this.once(method, path, { ...opts, upgrade: protocol });
      } finally {
        this.slots.give();
      }
      if ('socket' in a) return a;
      const err = a.status < 300 ? new TreewardenError(`${method} ${path}: answered ${a.status}, not upgraded`, { status: a.status }) : fromBody(a.status, parse(a.body));
      if (!(err instanceof Unavailable) || attempt >= this.retries || opts.signal?.aborted) throw err;
      this.retried += 1;
      await sleep(Math.min(this.maxRetryDelayMs, 25 * 2 ** attempt));
    }
  }

  async json<T = unknown>(method: string, path: string, opts: RequestOptions = {}): Promise<T> {
    const a = await this.request(method, path, opts);
    return parse(a.body) as T;
  }
}

function parse(body: Buffer): unknown {
  if (body.length === 0) return null;
  const text = body.toString('utf8');
  try {
    return JSON.parse(text);
  } catch {
    return text;
  }
}

/** `path?k=v&…`, leaving out what is undefined. */
export function query(path: string, params: Record<string, string | number | boolean | undefined>): string {
  const q = new URLSearchParams();
  for (const [k, v] of Object.entries(params)) {
    if (v === undefined) continue;
    q.set(k, typeof v === 'boolean' ? (v ? '1' : '0') : String(v));
  }
  const s = q.toString();
  return s ? `${path}?${s}` : path;
}
