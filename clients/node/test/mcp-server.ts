/**
 * A real MCP server, written with the MCP TypeScript SDK (`Server` over its
 * `StdioServerTransport`), for the transport tests (mcp.test.ts).
 *
 *     node mcp-server.js PIDFILE [--linger]
 *
 * It appends `server PID` to PIDFILE (the tests' only word on which
 * processes are the server's) and serves `add` and `pids`. `--linger`: a
 * timer keeps it up after its stdin ends (as server-everything's do), so
 * only a signal ends it.
 */

import { appendFileSync } from 'node:fs';

import { Server } from '@modelcontextprotocol/sdk/server/index.js';
import { StdioServerTransport } from '@modelcontextprotocol/sdk/server/stdio.js';
import { CallToolRequestSchema, ListToolsRequestSchema } from '@modelcontextprotocol/sdk/types.js';

const [pidfile, ...flags] = process.argv.slice(2);
appendFileSync(pidfile!, `server ${process.pid}\n`);

const server = new Server({ name: 'treewarden-fixture', version: '1.0.0' }, { capabilities: { tools: {} } });
server.setRequestHandler(ListToolsRequestSchema, async () => ({
  tools: [
    {
      name: 'add',
      description: 'Adds two integers.',
      inputSchema: { type: 'object', properties: { a: { type: 'integer' }, b: { type: 'integer' } }, required: ['a', 'b'] },
    },
    { name: 'pids', description: "The server's pid and its parent's.", inputSchema: { type: 'object', properties: {} } },
  ],
}));
server.setRequestHandler(CallToolRequestSchema, async (req) => {
  const args = (req.params.arguments ?? {}) as { a?: number; b?: number };
  const text = req.params.name === 'add' ? String((args.a ?? 0) + (args.b ?? 0)) : `${process.pid} ${process.ppid}`;
  return { content: [{ type: 'text', text }] };
});
if (flags.includes('--linger')) setInterval(() => undefined, 60_000);
await server.connect(new StdioServerTransport());
