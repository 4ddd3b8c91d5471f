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

const path = require('node:path');
const { parseArgs } = require('node:util');
const grpc = require('@grpc/grpc-js');
const protoLoader = require('@grpc/proto-loader');
const protobuf = require('protobufjs');

const { values: opts } = parseArgs({
  options: {
    registry: { type: 'string', default: '127.0.0.1:50051' },
    lease: { type: 'string', default: '127.0.0.1:50052' },
    'api-key': { type: 'string', default: '' },
    tenant: { type: 'string', default: '' },
    model: { type: 'string' },
    conversation: { type: 'string' },
    'block-size': { type: 'string' },
    hashes: { type: 'string', default: '' },
    'proto-dir': { type: 'string', default: path.join(__dirname, '..', '..', 'proto') },
    'deadline-ms': { type: 'string', default: '5000' },
  },
});
for (const name of ['model', 'conversation', 'block-size']) {
  if (opts[name] === undefined) throw new Error(`--${name} is required`);
}
const protoDir = opts['proto-dir'];

// keepCase: fields keep their proto names (conversation_key). Without it the loader expects camelCase keys
// (conversationKey) and silently drops snake_case ones: a keyed lookup becomes a content-addressed one.
// longs: String: uint64 ids (lease_id, epoch) as decimal strings; a JS number loses precision above 2^53.
const LOADER = { keepCase: true, longs: String, enums: String, defaults: true, oneofs: true, includeDirs: [protoDir] };
const defs = protoLoader.loadSync(
  ['kvbridge/registry/v1/registry.proto', 'kvbridge/lease/v1/lease.proto'], LOADER);
const api = grpc.loadPackageDefinition(defs);

// The google.rpc messages that carry error details (shipped in proto/google/rpc).
const rpcRoot = new protobuf.Root();
rpcRoot.resolvePath = (_origin, target) => path.join(protoDir, target);
rpcRoot.loadSync(['google/rpc/status.proto', 'google/rpc/error_details.proto'], { keepCase: true });
const Status = rpcRoot.lookupType('google.rpc.Status');
const ErrorInfo = rpcRoot.lookupType('google.rpc.ErrorInfo');

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
    client[method](request, metadata(), { deadline: deadline() }, (err, resp) => (err ? reject(err) : resolve(resp)));
  });
}

/** One KeepAlive round trip on the bidirectional stream: send the ids, read one response, close. */
function keepAliveOnce(client, leaseIds) {
  return new Promise((resolve, reject) => {
    const call = client.KeepAlive(metadata(), { deadline: deadline() });
    call.on('data', (resp) => { resolve(resp); call.end(); });
    call.on('error', (err) => { if (err.code !== grpc.status.CANCELLED) reject(err); });
    call.on('end', () => resolve(null));
    call.write({ lease_ids: leaseIds, conversations: [] });
  });
}

async function main() {
  const registry = new api.kvbridge.registry.v1.RegistryService(opts.registry, creds);
  const lease = new api.kvbridge.lease.v1.LeaseService(opts.lease, creds);
  const hashes = opts.hashes ? opts.hashes.split(',').map((h) => Buffer.from(h, 'hex')) : [];
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

main().catch((err) => {
  process.stderr.write(`kvbridge node client failed: ${err.stack || err}\n`);
  process.exit(1);
});
