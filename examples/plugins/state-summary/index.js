// An example kpng plugin in Node.js: after each change, one JSON line summing up the node's
// state (services, endpoints, node ports) on stdout or appended to a file.
//
//   node index.js --socket /run/kpng/plugins/summary.sock [--output FILE] [--proto-dir DIR]
//
// It loads kpng's .proto files at run time (@grpc/proto-loader: no generated code), asks for
// FULL states in JSON (every Apply is the whole state, its payloads protobuf's canonical JSON),
// and takes an optional JSON configuration: {"label": "..."} is copied into every line.
'use strict';

const fs = require('fs');
const path = require('path');
const grpc = require('@grpc/grpc-js');
const protoLoader = require('@grpc/proto-loader');

function parseArgs(argv) {
  const args = { socket: null, output: null, protoDir: path.join(__dirname, '..', '..', '..', 'src') };
  for (let i = 0; i < argv.length; i += 2) {
    const [flag, value] = [argv[i], argv[i + 1]];
    if (value === undefined) throw new Error(`${flag} needs a value`);
    if (flag === '--socket') args.socket = value;
    else if (flag === '--output') args.output = value;
    else if (flag === '--proto-dir') args.protoDir = value;
    else throw new Error(`unknown flag ${flag}`);
  }
  if (!args.socket) throw new Error('--socket PATH is required');
  return args;
}

// The proto directory holds kpng/api/pluginv1.proto (the repository's src/, or an installed
// kpng package's parent directory).
function loadApi(protoDir) {
  const definition = protoLoader.loadSync('kpng/api/pluginv1.proto', {
    includeDirs: [protoDir],
    keepCase: true, // kpng's fields are CamelCase, as Go KPNG's
    longs: Number,
    enums: String,
    defaults: true,
    oneofs: true, // OpItem's oneof as a virtual field: op.Op is 'Set', 'Delete', 'Reset' or 'Sync'
  });
  return grpc.loadPackageDefinition(definition).kpng.pluginv1;
}

// Pure: the summary of one whole state, from its ops.
function summarize(ops, revision, label) {
  let services = 0;
  let endpoints = 0;
  const nodePorts = [];
  for (const op of ops) {
    if (op.Op !== 'Set') continue;
    const value = JSON.parse(Buffer.from(op.Set.Bytes).toString('utf8'));
    if (op.Set.Ref.Set === 'ServicesSet') {
      services += 1;
      for (const port of value.Ports || []) {
        if (port.NodePort) nodePorts.push(port.NodePort);
      }
    } else if (op.Set.Ref.Set === 'EndpointsSet') {
      endpoints += 1;
    }
  }
  nodePorts.sort((a, b) => a - b);
  const summary = { revision, services, endpoints, nodePorts };
  if (label !== undefined) summary.label = label;
  return summary;
}

function main() {
  const args = parseArgs(process.argv.slice(2));
  const api = loadApi(args.protoDir);
  let node = '';
  let label;
  const write = (line) => {
    if (args.output) fs.appendFileSync(args.output, line + '\n');
    else process.stdout.write(line + '\n');
  };

  const server = new grpc.Server({
    // A whole state of a large cluster is more than gRPC's default 4 MiB.
    'grpc.max_receive_message_length': -1,
  });
  server.addService(api.Plugin.service, {
    Describe(call, callback) {
      callback(null, { Name: 'state-summary', Version: '1.0.0', Wants: 'FULL', Encoding: 'JSON' });
    },
    Configure(call, callback) {
      const config = Buffer.from(call.request.Config).toString('utf8').trim();
      try {
        label = config ? JSON.parse(config).label : undefined;
      } catch (err) {
        // A non-OK status refuses the configuration; kpng logs the message and retries.
        callback({ code: grpc.status.INVALID_ARGUMENT, details: `config is not JSON: ${err.message}` });
        return;
      }
      node = call.request.NodeName;
      console.error(`state-summary: configured for node ${node}`);
      callback(null, {});
    },
    Apply(call, callback) {
      const { Ops, Revision } = call.request;
      if (!Ops.length || Ops[0].Op !== 'Reset' || Ops[Ops.length - 1].Op !== 'Sync') {
        callback({ code: grpc.status.INVALID_ARGUMENT, details: 'expected a whole state' });
        return;
      }
      let summary;
      try {
        summary = summarize(Ops, Revision, label);
      } catch (err) {
        // A payload that is not JSON: refuse the change set, say why.
        callback({ code: grpc.status.INVALID_ARGUMENT, details: `bad payload: ${err.message}` });
        return;
      }
      write(JSON.stringify({ node, ...summary }));
      callback(null, {});
    },
    Health(call, callback) {
      callback(null, { Ok: true, Message: '' });
    },
  });

  if (fs.existsSync(args.socket)) fs.unlinkSync(args.socket); // a socket left by a crash
  server.bindAsync(`unix:${args.socket}`, grpc.ServerCredentials.createInsecure(), (err) => {
    if (err) {
      console.error(`state-summary: cannot listen on ${args.socket}: ${err.message}`);
      process.exit(1);
    }
    console.error(`state-summary: listening on unix:${args.socket}`);
  });
  const stop = () => server.tryShutdown(() => process.exit(0));
  process.on('SIGTERM', stop);
  process.on('SIGINT', stop);
}

main();
