#!/usr/bin/env node
// A Node.js client of the kvbridge gRPC API (@grpc/grpc-js + @grpc/proto-loader), the way docs/clients.md
// describes it: a keyed LookupEntry, a KeepAlive stream on the lease the lookup returned, and a bad request
// whose ErrorInfo is decoded from the grpc-status-details-bin trailer. Prints one JSON object on stdout.
//
//   node client.js --registry 127.0.0.1:50051 --lease 127.0.0.1:50052 --api-key KEY \
//     --tenant acme --model M --conversation conv-1 --block-size 16 --hashes HEX,HEX,...
//
// Run by tests/integration/test_node_client.py against an in-process stack.
'use strict';

const fs = require('node:fs');
const path = require('node:path');
const { parseArgs } = require('node:util');

const USAGE = `usage: npm start -- --model MODEL --conversation KEY --block-size N [--hashes HEX,HEX,... | --hashes-file FILE]
                 [--registry HOST:PORT] [--lease HOST:PORT] [--api-key KEY] [--tenant TENANT] [--deadline-ms MS]
  (or: node client.js ...). A keyed LookupEntry, one KeepAlive round on the lease it returns, and a bad lookup's
  ErrorInfo, printed as one JSON object. --hashes-file reads the JSON \`kvbridge hash\` prints (or a JSON array of hex).
  Defaults: --registry 127.0.0.1:50051 --lease 127.0.0.1:50052 (kvbridge up). See README.md.`;

/** A usage or input error: one line on stderr (and where to look), exit code 2; never a stack trace. */
function usageError(message) {
  process.stderr.write(`kvbridge node client: ${message} (--help for usage)\n`);
  process.exit(2);
}

let opts;
try {
  ({ values: opts } = parseArgs({
    options: {
      help: { type: 'boolean', short: 'h', default: false },
      registry: { type: 'string', default: '127.0.0.1:50051' },
      lease: { type: 'string', default: '127.0.0.1:50052' },
      'api-key': { type: 'string', default: '' },
      tenant: { type: 'string', default: '' },
      model: { type: 'string' },
      conversation: { type: 'string' },
      'block-size': { type: 'string' },
      hashes: { type: 'string', default: '' },
      'hashes-file': { type: 'string' },
      'proto-dir': { type: 'string', default: path.join(__dirname, '..', '..', 'proto') },
      'deadline-ms': { type: 'string', default: '5000' },
    },
  }));
} catch (err) {
  usageError(err.message);
}
if (opts.help) {
  process.stdout.write(`${USAGE}\n`);
  process.exit(0);
}
const missing = ['model', 'conversation', 'block-size'].filter((name) => opts[name] === undefined);
if (missing.length) usageError(`missing ${missing.map((n) => `--${n}`).join(', ')}`);
if (!/^[1-9][0-9]*$/.test(opts['block-size'])) usageError(`--block-size must be a positive integer, got ${opts['block-size']}`);

/** The hex hashes of --hashes (comma-separated) or --hashes-file (`kvbridge hash` output, or a JSON array). */
function hexHashes() {
  let list = opts.hashes ? opts.hashes.split(',') : [];
  if (opts['hashes-file'] !== undefined) {
    let parsed;
    try {
      parsed = JSON.parse(fs.readFileSync(opts['hashes-file'], 'utf8'));
    } catch (err) {
      usageError(`--hashes-file ${opts['hashes-file']}: ${err.message}`);
    }
    list = Array.isArray(parsed) ? parsed : parsed && parsed.hashes;
    if (!Array.isArray(list)) usageError(`--hashes-file ${opts['hashes-file']}: no "hashes" array`);
  }
  for (const h of list) {
    if (typeof h !== 'string' || !/^[0-9a-fA-F]{32}$/.test(h)) usageError(`a block hash is 32 hex digits, got ${JSON.stringify(h)}`);
  }
  return list;
}
const hexList = hexHashes();

let grpc;
let protoLoader;
let protobuf;
try {
  grpc = require('@grpc/grpc-js');
  protoLoader = require('@grpc/proto-loader');
  protobuf = require('protobufjs');
} catch (err) {
  process.stderr.write(`kvbridge node client: ${err.message.split('\n')[0]} (run \`npm ci\` in ${__dirname})\n`);
  process.exit(1);
}
const protoDir = opts['proto-dir'];

// keepCase: fields keep their proto names (conversation_key). Without it the loader expects camelCase keys
// (conversationKey) and silently drops snake_case ones: a keyed lookup becomes a content-addressed one.
// longs: String: uint64 ids (lease_id, epoch) as decimal strings; a JS number loses precision above 2^53.
const LOADER = { keepCase: true, longs: String, enums: String, defaults: true, oneofs: true, includeDirs: [protoDir] };
let api;
let Status;
let ErrorInfo;
try {
  api = grpc.loadPackageDefinition(protoLoader.loadSync(
    ['kvbridge/registry/v1/registry.proto', 'kvbridge/lease/v1/lease.proto'], LOADER));
  // The google.rpc messages that carry error details (shipped in proto/google/rpc).
  const rpcRoot = new protobuf.Root();
  rpcRoot.resolvePath = (_origin, target) => path.join(protoDir, target);
  rpcRoot.loadSync(['google/rpc/status.proto', 'google/rpc/error_details.proto'], { keepCase: true });
  Status = rpcRoot.lookupType('google.rpc.Status');
  ErrorInfo = rpcRoot.lookupType('google.rpc.ErrorInfo');
} catch (err) {
  usageError(`cannot load the protos from --proto-dir ${protoDir}: ${err.message.split('\n')[0]}`);
}

/** The ErrorInfo of a failed call ({reason, domain, metadata}), or null when the server sent none. */
function errorInfoOf(err) {
  const raw = err.metadata ? err.metadata.get('grpc-status-details-bin') : [];
  if (!raw.length) return null;
  const status = Status.decode(raw[0]);
  for (const any of status.details) {
    if (any.type_url === 'type.googleapis.com/google.rpc.ErrorInfo') {
      return ErrorInfo.toObject(ErrorInfo.decode(any.value), { defaults: true });
    }
  }
  return null;
}

const creds = grpc.credentials.createInsecure();
const metadata = () => {
  const md = new grpc.Metadata();
  if (opts['api-key']) md.set('authorization', `Bearer ${opts['api-key']}`);
  return md;
};
const deadline = () => new Date(Date.now() + Number(opts['deadline-ms']));  // every call has a deadline

function unary(client, method, request) {
  return new Promise((resolve, reject) => {
    client[method](request, metadata(), { deadline: deadline() }, (err, resp) => {
      if (err) { err.method = method; reject(err); } else resolve(resp);
    });
  });
}

/** One KeepAlive round trip on the bidirectional stream: send the ids, read one response, close. */
function keepAliveOnce(client, leaseIds) {
  return new Promise((resolve, reject) => {
    const call = client.KeepAlive(metadata(), { deadline: deadline() });
    call.on('data', (resp) => { resolve(resp); call.end(); });
    call.on('error', (err) => { if (err.code !== grpc.status.CANCELLED) { err.method = 'KeepAlive'; reject(err); } });
    call.on('end', () => resolve(null));
    call.write({ lease_ids: leaseIds, conversations: [] });
  });
}

async function main() {
  const registry = new api.kvbridge.registry.v1.RegistryService(opts.registry, creds);
  const lease = new api.kvbridge.lease.v1.LeaseService(opts.lease, creds);
  const hashes = hexList.map((h) => Buffer.from(h, 'hex'));
  const out = {};

  // 1. A keyed lookup: conversation_key set, so only that conversation's entry can answer.
  const found = await unary(registry, 'LookupEntry', {
    tenant: opts.tenant, model: opts.model, conversation_key: opts.conversation,
    block_hashes: hashes, block_size: Number(opts['block-size']),
  });
  const loc = found.location;
  out.lookup = {
    verdict: found.verdict, verified_tokens: found.verified_tokens,
    conversation_key: loc ? loc.conversation_key : '', lease_id: loc ? loc.lease_id : '',
    engine_id: loc && loc.engine ? loc.engine.engine_id : '',
  };

  // 2. KeepAlive on the lease the lookup returned: the id goes back exactly as it came (a string).
  if (loc) {
    const resp = await keepAliveOnce(lease, [loc.lease_id]);
    out.keepalive = resp ? resp.statuses.map((s) => ({ lease_id: s.lease_id, alive: s.alive, error: s.error })) : [];
  }

  // 3. Bad input: a packed chain whose length is not a multiple of 16 bytes -> INVALID_ARGUMENT + ErrorInfo.
  try {
    await unary(registry, 'LookupEntry', {
      tenant: opts.tenant, model: opts.model, conversation_key: opts.conversation,
      block_hashes_packed: Buffer.alloc(5), block_size: Number(opts['block-size']),
    });
    out.error = { code: 'OK' };
  } catch (err) {
    out.error = { code: grpc.status[err.code], details: err.details, info: errorInfoOf(err) };
  }

  registry.close();
  lease.close();
  process.stdout.write(`${JSON.stringify(out)}\n`);
}

/** One line for a failed call: the method, gRPC's code and message, and a hint when nothing answered. */
function failure(err) {
  if (err && err.code !== undefined && grpc.status[err.code]) {
    const info = errorInfoOf(err);
    const details = String(err.details).replace(/\.?\s*Resolution note:\s*$/, '');
    let line = `${err.method || 'call'} failed: ${grpc.status[err.code]}: ${details}`;
    if (info && info.reason) line += ` (reason ${info.reason})`;
    if (err.code === grpc.status.UNAVAILABLE || err.code === grpc.status.DEADLINE_EXCEEDED) {
      line += ` -- is kvbridge running (registry ${opts.registry}, lease manager ${opts.lease})? \`kvbridge up\` starts both`;
    }
    return line;
  }
  return String(err && err.message ? err.message : err).split('\n')[0];
}

main().catch((err) => {
  process.stderr.write(`kvbridge node client: ${failure(err)}\n`);
  if (process.env.KVBRIDGE_DEBUG) process.stderr.write(`${err && err.stack}\n`);
  process.exit(1);
});
