/**
 * A host that holds an MCP server and is then SIGKILLed (mcp.test.ts).
 *
 *     node mcp-owner.js SOCKET|plain PIDFILE MARK
 *
 * It starts the fixture server (lingering) through the shim, with
 * `TreewardenStdioClientTransport` on SOCKET or the SDK's own
 * `StdioClientTransport` (`plain`), connects (initialize), calls a tool,
 * prints `ready` and waits for its kill.
 */

import * as path from 'node:path';
import { fileURLToPath } from 'node:url';

import { Client as McpClient } from '@modelcontextprotocol/sdk/client/index.js';
import { StdioClientTransport } from '@modelcontextprotocol/sdk/client/stdio.js';
import type { Transport } from '@modelcontextprotocol/sdk/shared/transport.js';

import { Client } from '../src/index.js';
import { TreewardenStdioClientTransport } from '../src/mcp.js';

const HERE = path.dirname(fileURLToPath(import.meta.url));
const [where, pidfile, mark] = process.argv.slice(2) as [string, string, string];
const params = {
  command: process.execPath,
  args: [path.join(HERE, 'mcp-shim.js'), pidfile, '--', process.execPath, path.join(HERE, 'mcp-server.js'), pidfile, '--linger'],
  env: { TW_NODE_MARK: mark },
};
const transport: Transport =
  where === 'plain'
    ? new StdioClientTransport(params)
    : new TreewardenStdioClientTransport({ ...params, client: new Client({ socketPath: where }), label: `${mark}-owner` });
const mcp = new McpClient({ name: 'owner', version: '1.0.0' });
await mcp.connect(transport);
await mcp.callTool({ name: 'add', arguments: { a: 1, b: 1 } });
console.log('ready');
setInterval(() => undefined, 60_000);
