/**
 * treewarden from Node: process trees in custody, shaped like
 * `child_process`. No runtime dependency (Node 20 or later).
 */

export {
  Client,
  type ClientOptions,
  type Duration,
  type EndReason,
  type Outcome,
  type RunResult,
  type SpawnOptions,
  TreeProcess,
  defaultSocket,
  duration,
  outcomeOf,
  ownIdentity,
} from './client.js';
export * from './errors.js';
export { type Endpoint, type TransportOptions } from './http.js';
export { type StdioOption, type StdioSlot } from './stdio.js';
