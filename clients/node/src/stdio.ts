/**
 * Streamed stdio: a tree's stdin, stdout and stderr over the spawn's own
 * connection, upgraded to `treewarden-stdio/1` (the service's 101). The
 * connection carries frames `[stream u8][length u32 BE][payload]`: 0
 * stdin (to the service), 1 stdout, 2 stderr (a frame of length 0 ends
 * its stream), 3 exit, last (the tree's end, as `wait` answers it).
 *
 * Back-pressure both ways: the socket is paused while a consumer of
 * stdout or stderr does not read, so the service stops reading the tree
 * (its pipe fills, the tree waits); a stdin write completes once the
 * socket took it.
 */

import type { Socket } from 'node:net';
import { Readable, Writable } from 'node:stream';

export const PROTOCOL = 'treewarden-stdio/1';
const STDIN = 0;
const STDOUT = 1;
const STDERR = 2;
const EXIT = 3;
/** The largest stdin frame the service takes. */
const MAX_IN_FRAME = 1 << 20;

/** What becomes of one of the tree's descriptors 0, 1, 2. */
export type StdioSlot = 'pipe' | 'ignore' | 'inherit';
/** As `child_process`: one slot for all three, or one each. */
export type StdioOption = StdioSlot | readonly [StdioSlot, StdioSlot, StdioSlot];

/** The three slots of `opt`, or `undefined` when nothing is streamed (all `ignore`, or none asked). */
export function stdioSlots(opt: StdioOption | undefined): [StdioSlot, StdioSlot, StdioSlot] | undefined {
  if (opt === undefined) return undefined;
  const slots = (typeof opt === 'string' ? [opt, opt, opt] : [...opt]) as [StdioSlot, StdioSlot, StdioSlot];
  if (slots.length !== 3 || slots.some((s) => s !== 'pipe' && s !== 'ignore' && s !== 'inherit')) {
    throw new TypeError(`stdio is 'pipe', 'ignore', 'inherit' or an array of three of them, not ${JSON.stringify(opt)}`);
  }
  return slots.every((s) => s === 'ignore') ? undefined : slots;
}

function frame(stream: number, payload: Buffer): Buffer {
  const head = Buffer.allocUnsafe(5);
  head[0] = stream;
  head.writeUInt32BE(payload.length, 1);
  return payload.length === 0 ? head : Buffer.concat([head, payload]);
}

/**
 * The client's end of one tree's streamed stdio. Its streams exist from
 * the spawn on (writes to stdin wait for the connection); `exit` settles
 * with the exit frame's JSON, or `null` when the connection ended first.
 */
export class StdioStreams {
  readonly stdin: Writable | null;
  readonly stdout: Readable | null;
  readonly stderr: Readable | null;
  readonly exit: Promise<Record<string, unknown> | null>;
  private socket: Socket | undefined;
  private attached!: (s: Socket | undefined) => void;
  private readonly attaching: Promise<Socket | undefined>;
  private exited!: (v: Record<string, unknown> | null) => void;
  private buf: Buffer = Buffer.alloc(0);
  /** Readables over their high-water mark: the socket stays paused while any is. */
  private readonly full = new Set<Readable>();
  private done = false;
  /** The outputs whose end was pushed. */
  private readonly ended = new Set<Readable>();

  constructor(private readonly slots: [StdioSlot, StdioSlot, StdioSlot]) {
    this.attaching = new Promise((resolve) => (this.attached = resolve));
    this.exit = new Promise((resolve) => (this.exited = resolve));
    this.stdin =
      slots[0] === 'pipe'
        ? new Writable({
            write: (chunk: Buffer, _enc, cb) => void this.send(chunk).then(() => cb(), cb),
            final: (cb) => void this.send(Buffer.alloc(0)).then(() => cb(), cb),
          })
        : null;
    const readable = (): Readable => {
      const r: Readable = new Readable({
        read: () => {
          this.full.delete(r);
          if (this.full.size === 0) this.socket?.resume();
        },
      });
      return r;
    };
    this.stdout = slots[1] === 'pipe' ? readable() : null;
    this.stderr = slots[2] === 'pipe' ? readable() : null;
  }

  /** Takes the upgraded connection (and the bytes that came with the 101). */
  attach(socket: Socket, head: Buffer): void {
    this.socket = socket;
    socket.setNoDelay(true);
    socket.on('data', (d: Buffer) => this.take(d));
    socket.on('error', () => this.end());
    socket.on('close', () => this.end());
    if (head.length > 0) this.take(head);
    this.attached(socket);
    if (this.slots[0] !== 'pipe') void this.send(Buffer.alloc(0));
  }

  /** The spawn failed: the streams end, nothing was created. */
  fail(e: unknown): void {
    this.attached(undefined);
    void e;
    this.stdin?.destroy();
    this.end();
  }

  /** Hangs up (the tree's stdin is closed; the tree lives by its lifetime rules). */
  close(): void {
    this.socket?.destroy();
  }

  /** Sets whether the connection holds the event loop open. */
  ref(on: boolean): void {
    if (on) this.socket?.ref();
    else this.socket?.unref();
  }

  private async send(payload: Buffer): Promise<void> {
    const socket = await this.attaching;
    // After the connection ended, what is written is dropped, as a pipe
    // to an exited process would refuse it: a tree's end is told by
    // 'exit', not by a write error nobody listens to.
    if (!socket || socket.destroyed || this.done) return;
    let at = 0;
    do {
      const part = payload.subarray(at, at + MAX_IN_FRAME);
      at += part.length;
      // Done once the socket handed the bytes to the kernel.
      await new Promise<void>((resolve) => socket.write(frame(STDIN, part), () => resolve()));
    } while (at < payload.length);
  }

  private take(d: Buffer): void {
    this.buf = this.buf.length === 0 ? d : Buffer.concat([this.buf, d]);
    while (this.buf.length >= 5) {
      const len = this.buf.readUInt32BE(1);
      if (this.buf.length < 5 + len) break;
      const stream = this.buf[0];
      const payload = this.buf.subarray(5, 5 + len);
      this.buf = this.buf.subarray(5 + len);
      this.frame(stream, payload);
    }
  }

  private frame(stream: number, payload: Buffer): void {
    if (stream === EXIT) {
      let v: Record<string, unknown> | null = null;
      try {
        v = JSON.parse(payload.toString('utf8')) as Record<string, unknown>;
      } catch {
        v = null;
      }
      this.exited(v);
      this.end();
      this.socket?.end();
      return;
    }
    const slot = stream === STDOUT ? 1 : stream === STDERR ? 2 : undefined;
    if (slot === undefined) return;
    const r = slot === 1 ? this.stdout : this.stderr;
    if (this.slots[slot] === 'inherit') {
      if (payload.length > 0) (slot === 1 ? process.stdout : process.stderr).write(Buffer.from(payload));
      return;
    }
    if (!r) return;
    if (this.ended.has(r)) return;
    if (payload.length === 0) {
      this.ended.add(r);
      r.push(null);
      return;
    }
    if (!r.push(Buffer.from(payload))) {
      this.full.add(r);
      this.socket?.pause();
    }
  }

  /** The connection is over: the outputs end, `exit` settles (null if no exit frame came). */
  private end(): void {
    if (this.done) return;
    this.done = true;
    for (const r of [this.stdout, this.stderr]) {
      if (r && !this.ended.has(r) && !r.destroyed) {
        this.ended.add(r);
        r.push(null);
      }
    }
    this.exited(null);
  }
}
