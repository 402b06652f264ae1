'use strict';
// A worker of the paramserver job written from protos/paramserver/v1/{ps.proto,SPEC.md,vectors.json} alone:
// it joins every shard, initialises them with a tiny model (linear regression, float32 tensors), trains it on
// synthetic data made here, and prints one JSON line with the result.
//
//   node train.js --server HOST:PORT [--steps 50] [--streams] [--big] [--dtype float32|bf16|fp16]
//                 [--bad-digest] [--timeout SECONDS]
//
// --streams     push and pull with the Push/Pull streams for every shard (default: one inline Exchange per shard
//               whose part fits in 1 MiB of wire bytes, the streams for larger parts: SPEC.md section 9)
// --big         add a 1,100,000-element tensor, which the servers' slice size (1048576) cuts over the shards
// --dtype       element type on the wire (SPEC.md section 4); the printed weights are those received
// --bad-digest  send Init with a wrong digest and print the statuses the shards answer (no training)

const crypto = require('node:crypto');
const os = require('node:os');
const path = require('node:path');
const grpc = require('@grpc/grpc-js');
const protoLoader = require('@grpc/proto-loader');
const { DEFAULT_SLICE_ELEMENTS, digest, place, shardElements } = require('./placement');

const PROTO_ROOT = path.join(__dirname, '..', '..', 'protos');
const MIB = 1 << 20;
const INLINE_BYTES = MIB; // SPEC.md section 9: a part up to 1 MiB of wire bytes goes inline
const CHUNK_BYTES = MIB; // SPEC.md section 5.4
const MAX_MESSAGE = 4 * MIB + 4096;

// -- arguments ------------------------------------------------------------------------------------------------

function parseArgs(argv) {
  const args = { server: '', steps: 50, streams: false, big: false, dtype: 'float32', badDigest: false, timeout: 60 };
  for (let i = 0; i < argv.length; i++) {
    const a = argv[i];
    const value = () => {
      if (i + 1 >= argv.length) throw new Error(`${a} needs a value`);
      return argv[++i];
    };
    if (a === '--server') args.server = value();
    else if (a === '--steps') args.steps = parseInt(value(), 10);
    else if (a === '--streams') args.streams = true;
    else if (a === '--big') args.big = true;
    else if (a === '--dtype') args.dtype = value();
    else if (a === '--bad-digest') args.badDigest = true;
    else if (a === '--timeout') args.timeout = parseFloat(value());
    else throw new Error(`unknown argument ${a}`);
  }
  if (!args.server) throw new Error('--server HOST:PORT is required');
  if (!(args.steps >= 0)) throw new Error('--steps must be a number >= 0');
  if (!DTYPES[args.dtype]) throw new Error(`--dtype must be one of ${Object.keys(DTYPES).join(', ')}`);
  return args;
}

// -- element types (SPEC.md section 4) ------------------------------------------------------------------------

const LITTLE_ENDIAN = os.endianness() === 'LE';
const f32 = new Float32Array(1);
const u32 = new Uint32Array(f32.buffer);

function bitsOf(x) {
  f32[0] = x;
  return u32[0];
}

function floatOf(bits) {
  u32[0] = bits >>> 0;
  return f32[0];
}

function toBfloat16(x) {
  const bits = bitsOf(x);
  if ((bits & 0x7fffffff) > 0x7f800000) return ((bits >>> 16) | 0x40) & 0xffff; // NaN stays a (quiet) NaN
  return Math.floor((bits + 0x7fff + ((bits >>> 16) & 1)) / 65536) & 0xffff; // round to nearest even
}

function toFloat16(x) {
  const bits = bitsOf(x);
  const sign = (bits >>> 16) & 0x8000;
  const exp = (bits >>> 23) & 0xff;
  let mant = bits & 0x7fffff;
  if (exp === 0xff) return sign | 0x7c00 | (mant ? 0x200 : 0); // Inf, NaN
  const e = exp - 127 + 15;
  if (e >= 0x1f) return sign | 0x7c00; // overflow: Inf
  if (e <= 0) {
    if (e < -10) return sign; // below half the smallest subnormal: zero
    mant |= 0x800000;
    const shift = 14 - e;
    let half = mant >>> shift;
    const rest = mant & ((1 << shift) - 1);
    const halfway = 1 << (shift - 1);
    if (rest > halfway || (rest === halfway && half & 1)) half++;
    return sign | half;
  }
  let half = (e << 10) | (mant >>> 13);
  const rest = mant & 0x1fff;
  if (rest > 0x1000 || (rest === 0x1000 && half & 1)) half++; // a carry into the exponent is right (up to Inf)
  return sign | half;
}

function fromFloat16(h) {
  const sign = h & 0x8000 ? -1 : 1;
  const e = (h >>> 10) & 0x1f;
  const m = h & 0x3ff;
  if (e === 0) return sign * m * 2 ** -24;
  if (e === 31) return m ? NaN : sign * Infinity;
  return sign * (1 + m / 1024) * 2 ** (e - 15);
}

const DTYPES = {
  float32: {
    wire: 'FLOAT32',
    size: 4,
    encode(values) {
      if (LITTLE_ENDIAN) return Buffer.from(new Uint8Array(values.buffer, values.byteOffset, values.byteLength));
      const out = Buffer.allocUnsafe(values.length * 4);
      for (let i = 0; i < values.length; i++) out.writeFloatLE(values[i], 4 * i);
      return out;
    },
    decodeInto(dst, data) {
      for (let i = 0; i < dst.length; i++) dst[i] = data.readFloatLE(4 * i);
    },
  },
  bf16: {
    wire: 'BFLOAT16',
    size: 2,
    encode(values) {
      const out = Buffer.allocUnsafe(values.length * 2);
      for (let i = 0; i < values.length; i++) out.writeUInt16LE(toBfloat16(values[i]), 2 * i);
      return out;
    },
    decodeInto(dst, data) {
      for (let i = 0; i < dst.length; i++) dst[i] = floatOf(data.readUInt16LE(2 * i) << 16);
    },
  },
  fp16: {
    wire: 'FLOAT16',
    size: 2,
    encode(values) {
      const out = Buffer.allocUnsafe(values.length * 2);
      for (let i = 0; i < values.length; i++) out.writeUInt16LE(toFloat16(values[i]), 2 * i);
      return out;
    },
    decodeInto(dst, data) {
      for (let i = 0; i < dst.length; i++) dst[i] = fromFloat16(data.readUInt16LE(2 * i));
    },
  },
};

// -- chunks (SPEC.md section 5) -------------------------------------------------------------------------------

// Chunks covering each view (one per piece, in piece order) once: one per piece per CHUNK_BYTES of wire bytes.
function chunksOf(views, dtype) {
  const step = Math.floor(CHUNK_BYTES / dtype.size);
  const chunks = [];
  views.forEach((view, piece) => {
    for (let offset = 0; offset < view.length; offset += step) {
      chunks.push({ piece, offset, data: dtype.encode(view.subarray(offset, offset + step)) });
    }
  });
  return chunks;
}

// Writes received chunks into the views, refusing anything outside them, overlapping or incomplete.
class Receiver {
  constructor(views, dtype) {
    this.views = views;
    this.dtype = dtype;
    this.ranges = views.map(() => []);
    this.filled = views.map(() => 0);
  }

  add(chunk) {
    const { piece, offset } = chunk;
    const data = Buffer.from(chunk.data.buffer, chunk.data.byteOffset, chunk.data.byteLength);
    if (!(piece >= 0 && piece < this.views.length)) {
      throw new Error(`chunk for piece ${piece}, but the shard has ${this.views.length} pieces`);
    }
    if (data.length === 0 || data.length % this.dtype.size) throw new Error(`chunk of ${data.length} bytes`);
    const n = data.length / this.dtype.size;
    const view = this.views[piece];
    if (offset < 0 || offset + n > view.length) {
      throw new Error(`chunk [${offset}, ${offset + n}) outside piece ${piece} of ${view.length} elements`);
    }
    for (const [a, b] of this.ranges[piece]) {
      if (offset < b && a < offset + n) throw new Error(`chunk [${offset}, ${offset + n}) of piece ${piece} overlaps`);
    }
    this.ranges[piece].push([offset, offset + n]);
    this.filled[piece] += n;
    this.dtype.decodeInto(view.subarray(offset, offset + n), data);
  }

  finish() {
    this.views.forEach((view, k) => {
      if (this.filled[k] !== view.length) throw new Error(`piece ${k}: ${this.filled[k]} of ${view.length} elements`);
    });
  }
}

// -- gRPC plumbing --------------------------------------------------------------------------------------------

const definition = protoLoader.loadSync('paramserver/v1/ps.proto', {
  keepCase: true,
  longs: Number,
  enums: String,
  defaults: true,
  oneofs: true,
  includeDirs: [PROTO_ROOT],
});
const ps = grpc.loadPackageDefinition(definition).paramserver.v1;
const CODE = Object.fromEntries(Object.entries(grpc.status).map(([name, code]) => [code, name]));

function newClient(address) {
  return new ps.ParameterServer(address, grpc.credentials.createInsecure(), {
    'grpc.max_receive_message_length': MAX_MESSAGE,
    'grpc.max_send_message_length': MAX_MESSAGE,
  });
}

// A gRPC error with the status name and the ps-error type (SPEC.md section 12) attached.
function described(err, what) {
  err.status = CODE[err.code] || String(err.code);
  const named = err.metadata ? err.metadata.get('ps-error') : [];
  err.psError = named.length ? String(named[0]) : '';
  err.message = `${what}: ${err.status}${err.psError ? ` (${err.psError})` : ''}: ${err.details || err.message}`;
  return err;
}

const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));

class Worker {
  constructor(args) {
    this.args = args;
    this.dtype = DTYPES[args.dtype];
    this.workerId = crypto.randomUUID().replace(/-/g, '');
    this.clients = [];
    this.joined = false;
    this.heartbeat = null;
    this.stats = { retries: 0, rejoins: 0, stale: 0, duplicates: 0 };
  }

  deadline() {
    return new Date(Date.now() + this.args.timeout * 1000);
  }

  unary(k, method, request) {
    return new Promise((resolve, reject) => {
      this.clients[k][method](request, { deadline: this.deadline() }, (err, reply) =>
        err ? reject(described(err, `shard ${k} ${method}`)) : resolve(reply),
      );
    });
  }

  // A client stream (Init, Push): the header message, then one message per chunk.
  clientStream(k, method, header, chunks) {
    return new Promise((resolve, reject) => {
      const call = this.clients[k][method]({ deadline: this.deadline() }, (err, reply) =>
        err ? reject(described(err, `shard ${k} ${method}`)) : resolve(reply),
      );
      call.write({ header });
      for (const chunk of chunks) call.write({ chunk });
      call.end();
    });
  }

  // -- topology and membership ----------------------------------------------------------------------------

  async connect() {
    const entry = newClient(this.args.server);
    const began = Date.now();
    try {
      for (;;) {
        try {
          this.topology = await new Promise((resolve, reject) =>
            entry.GetTopology({}, { deadline: new Date(Date.now() + 5000) }, (err, reply) =>
              err ? reject(described(err, `${this.args.server} GetTopology`)) : resolve(reply),
            ),
          );
          break;
        } catch (err) {
          if (err.code !== grpc.status.UNAVAILABLE || Date.now() - began > 30000) throw err;
          await sleep(500);
        }
      }
    } finally {
      entry.close();
    }
    this.addresses = this.topology.shards;
    this.clients = this.addresses.map(newClient);
    this.versions = this.addresses.map(() => 0);
    this.minNext = this.addresses.map(() => 0);
    this.incarnation = this.addresses.map(() => '');
    this.slice = Number(this.topology.slice_elements) || DEFAULT_SLICE_ELEMENTS;
  }

  async joinShard(k) {
    const began = Date.now();
    for (;;) {
      try {
        return await this.unary(k, 'Join', { worker_id: this.workerId, job_name: '' });
      } catch (err) {
        const retry = err.psError === 'JobFull' || err.code === grpc.status.UNAVAILABLE;
        if (!retry || Date.now() - began > 30000) throw err;
        await sleep(500);
      }
    }
  }

  // SPEC.md section 6, steps 2 and 3: shard 0 first (its rank counts), then the others; heartbeats from then on.
  async join() {
    const first = await this.joinShard(0);
    const rest = await Promise.all(this.addresses.slice(1).map((_, i) => this.joinShard(i + 1)));
    this.rank = first.rank;
    this.worldSize = first.world_size;
    this.joined = true;
    const leases = [first, ...rest].map((r) => r.lease_timeout_s).filter((x) => x > 0);
    const lease = leases.length ? Math.min(...leases) : 10;
    this.heartbeat = setInterval(() => this.beat(), (lease * 1000) / 3);
    this.heartbeat.unref();
  }

  beat() {
    this.addresses.forEach((_, k) => {
      this.unary(k, 'Heartbeat', { worker_id: this.workerId }).catch((err) => {
        if (err.psError === 'UnknownWorker' && this.joined) this.rejoin(k).catch(() => {});
      });
    });
  }

  async rejoin(k) {
    await this.unary(k, 'Join', { worker_id: this.workerId, job_name: '' });
    this.minNext[k] = 0;
    this.stats.rejoins++;
  }

  async leave() {
    if (this.heartbeat) clearInterval(this.heartbeat);
    this.heartbeat = null;
    if (!this.joined) return;
    this.joined = false;
    await Promise.allSettled(
      this.addresses.map((_, k) => this.unary(k, 'Leave', { worker_id: this.workerId, finished: true })),
    );
  }

  close() {
    if (this.heartbeat) clearInterval(this.heartbeat);
    for (const c of this.clients) c.close();
  }

  // -- the model ------------------------------------------------------------------------------------------

  bind(tensors) {
    this.tensors = tensors; // [{name, shape, data: Float32Array}] in model order
    this.specs = tensors.map((t) => ({ name: t.name, shape: t.shape }));
    this.shards = place(this.specs, this.addresses.length, this.slice);
    this.digest = digest(this.specs, this.addresses.length, this.slice);
    this.byName = new Map(tensors.map((t) => [t.name, t]));
  }

  // One view per piece of shard k, into the given flat arrays (by tensor name).
  views(k, flats) {
    return this.shards[k].map((p) => flats.get(p.name).subarray(p.start, p.start + p.length));
  }

  weights() {
    return new Map(this.tensors.map((t) => [t.name, t.data]));
  }

  inline(k) {
    return !this.args.streams && shardElements(this.shards[k]) * this.dtype.size <= INLINE_BYTES;
  }

  initHeader(modelDigest) {
    return {
      worker_id: this.workerId,
      specs: this.specs,
      num_shards: this.addresses.length,
      model_digest: modelDigest,
      dtype: 'FLOAT32',
    };
  }

  // SPEC.md section 6, step 4.
  async initShard(k) {
    const topo = await this.onShard(k, () => this.unary(k, 'GetTopology', {}));
    if (topo.initialized) {
      if (topo.model_digest !== this.digest) {
        const theirs = topo.model_digest.slice(0, 12);
        throw new Error(`shard ${k} holds another model (${theirs}, ours ${this.digest.slice(0, 12)})`);
      }
      return 'adopted';
    }
    const chunks = chunksOf(this.views(k, this.weights()), DTYPES.float32);
    try {
      await this.onShard(k, () => this.clientStream(k, 'Init', this.initHeader(this.digest), chunks));
      return 'initialised';
    } catch (err) {
      if (err.code === grpc.status.ALREADY_EXISTS) return 'adopted'; // another worker won the race
      throw err;
    }
  }

  // Init every shard with a corrupted digest; report what each answers.
  async badDigest() {
    const wrong = (this.digest[0] === '0' ? '1' : '0') + this.digest.slice(1);
    const chunks = (k) => chunksOf(this.views(k, this.weights()), DTYPES.float32);
    const results = await Promise.allSettled(
      this.addresses.map((_, k) => this.clientStream(k, 'Init', this.initHeader(wrong), chunks(k))),
    );
    return results.map((r, k) =>
      r.status === 'fulfilled'
        ? { shard: k, status: 'OK' }
        : { shard: k, status: r.reason.status, ps_error: r.reason.psError, details: r.reason.details },
    );
  }

  // -- push and pull (SPEC.md sections 7 to 9) --------------------------------------------------------------

  pulled(k, header) {
    if (header.model_digest !== this.digest) {
      throw new Error(`shard ${k} holds another model (${header.model_digest.slice(0, 12)})`);
    }
    if (header.incarnation !== this.incarnation[k]) {
      this.incarnation[k] = header.incarnation;
      this.minNext[k] = 0;
    }
    this.versions[k] = Number(header.version);
  }

  // Shard k's part of one exchange: push `grads` (a Map name -> Float32Array, or null) with `step`, then pull
  // into the model's weights when `pull`. Returns the shard's version.
  async exchange(k, grads, step, pull) {
    return this.inline(k) ? this.exchangeInline(k, grads, step, pull) : this.exchangeStreams(k, grads, step, pull);
  }

  async exchangeInline(k, grads, step, pull) {
    const base = this.versions[k];
    const request = {
      worker_id: this.workerId,
      model_digest: this.digest,
      push: grads !== null,
      step,
      base_version: base,
      pull,
      min_version: grads !== null ? base + 1 : this.minNext[k],
      incarnation: this.incarnation[k],
      inline: true,
      dtype: this.dtype.wire,
      chunks: grads !== null ? chunksOf(this.views(k, grads), this.dtype) : [],
    };
    let reply;
    try {
      reply = await this.unary(k, 'Exchange', request);
    } catch (err) {
      if (grads !== null && err.code === grpc.status.DEADLINE_EXCEEDED) this.minNext[k] = base + 1;
      throw err;
    }
    if (grads !== null) {
      this.minNext[k] = base + 1;
      if (!reply.applied) this.stats.duplicates++;
    }
    if (!pull) return Number(reply.version);
    const receiver = new Receiver(this.views(k, this.weights()), this.dtype);
    for (const chunk of reply.chunks) receiver.add(chunk);
    receiver.finish();
    this.pulled(k, reply.pulled);
    return Number(reply.pulled.version);
  }

  async exchangeStreams(k, grads, step, pull) {
    let version = this.versions[k];
    if (grads !== null) {
      const base = this.versions[k];
      const header = {
        worker_id: this.workerId,
        step,
        base_version: base,
        model_digest: this.digest,
        dtype: this.dtype.wire,
      };
      const reply = await this.clientStream(k, 'Push', header, chunksOf(this.views(k, grads), this.dtype));
      this.minNext[k] = base + 1;
      if (!reply.applied) this.stats.duplicates++;
      version = Number(reply.version);
    }
    if (pull) version = await this.pullStream(k);
    return version;
  }

  pullStream(k) {
    const request = {
      worker_id: this.workerId,
      min_version: this.minNext[k],
      dtype: this.dtype.wire,
      incarnation: this.incarnation[k],
    };
    const receiver = new Receiver(this.views(k, this.weights()), this.dtype);
    return new Promise((resolve, reject) => {
      let header = null;
      let failed = false;
      const fail = (err) => {
        if (!failed) {
          failed = true;
          reject(err);
        }
      };
      const call = this.clients[k].Pull(request, { deadline: this.deadline() });
      call.on('data', (message) => {
        try {
          if (message.kind === 'header') {
            if (header !== null) throw new Error(`shard ${k} sent a second pull header`);
            header = message.header;
            if (header.model_digest !== this.digest) throw new Error(`shard ${k} holds another model`);
          } else {
            if (header === null) throw new Error(`shard ${k} sent a chunk before the pull header`);
            receiver.add(message.chunk);
          }
        } catch (err) {
          fail(err);
          call.cancel();
        }
      });
      call.on('error', (err) => fail(described(err, `shard ${k} Pull`)));
      call.on('end', () => {
        if (failed) return;
        try {
          if (header === null) throw new Error(`shard ${k} ended a pull without its header`);
          receiver.finish();
          this.pulled(k, header);
          resolve(Number(header.version));
        } catch (err) {
          fail(err);
        }
      });
    });
  }

  // Run fn against shard k, retrying what SPEC.md section 12 says to retry: UNAVAILABLE with backoff (a push
  // keeps its step: the shard deduplicates it), ABORTED UnknownWorker after joining again, DEADLINE_EXCEEDED of a
  // pull (min_next already covers the push).
  async onShard(k, fn) {
    let delay = 50;
    const deadline = Date.now() + this.args.timeout * 1000;
    let rejoined = false;
    for (;;) {
      try {
        return await fn();
      } catch (err) {
        if (Date.now() + delay > deadline) throw err;
        if (err.code === grpc.status.UNAVAILABLE) {
          this.stats.retries++;
          await sleep(delay);
          delay = Math.min(2 * delay, 2000);
        } else if (err.psError === 'UnknownWorker' && this.joined && !rejoined) {
          rejoined = true;
          await this.rejoin(k);
        } else {
          throw err;
        }
      }
    }
  }

  // One training step on every shard at once: push the gradient, pull the weights that include it. A push the
  // shard refused as stale (its round closed without it) is dropped, and that shard is pulled to catch up.
  async step(grads, step) {
    return Promise.all(
      this.addresses.map(async (_, k) => {
        try {
          return await this.onShard(k, () => this.exchange(k, grads, step, true));
        } catch (err) {
          if (err.psError === 'StaleRound') {
            this.stats.stale++;
            return this.pullShard(k);
          }
          if (err.code === grpc.status.DEADLINE_EXCEEDED) return this.pullShard(k);
          throw err;
        }
      }),
    );
  }

  pullShard(k) {
    return this.onShard(k, () => this.exchange(k, null, 0, true));
  }

  pullAll() {
    return Promise.all(this.addresses.map((_, k) => this.pullShard(k)));
  }
}

// -- the model and its data (deterministic) -------------------------------------------------------------------

function mulberry32(seed) {
  let a = seed >>> 0;
  return () => {
    a = (a + 0x6d2b79f5) >>> 0;
    let t = a;
    t = Math.imul(t ^ (t >>> 15), t | 1);
    t ^= t + Math.imul(t ^ (t >>> 7), t | 61);
    return ((t ^ (t >>> 14)) >>> 0) / 4294967296;
  };
}

const FEATURES = 8;
const SAMPLES = 256;
const BATCH = 32;
const TRUE_W = [0.5, -1.0, 2.0, -0.3, 1.5, 0.0, -2.0, 0.8];
const TRUE_B = 0.7;
const BIG_NAME = 'emb.é"\\😀'; // sliced over the shards; a name that needs every kind of escape in the digest
const BIG_ELEMENTS = 1100000;

function makeData() {
  const rand = mulberry32(1234);
  const x = new Float64Array(SAMPLES * FEATURES);
  const y = new Float64Array(SAMPLES);
  for (let i = 0; i < SAMPLES; i++) {
    let t = TRUE_B;
    for (let j = 0; j < FEATURES; j++) {
      const v = 2 * rand() - 1;
      x[i * FEATURES + j] = v;
      t += v * TRUE_W[j];
    }
    y[i] = t;
  }
  return { x, y };
}

function makeModel(big) {
  const rand = mulberry32(42);
  const tensors = [
    { name: 'w', shape: [FEATURES, 1], data: new Float32Array(FEATURES).map(() => 0.2 * rand() - 0.1) },
    { name: 'b', shape: [1], data: new Float32Array(1) },
  ];
  if (big) tensors.push({ name: BIG_NAME, shape: [BIG_ELEMENTS], data: new Float32Array(BIG_ELEMENTS) });
  return tensors;
}

function bigTarget(i) {
  return Math.sin(i * 0.001);
}

// The objective: the mean squared error of the regression over all samples, plus (--big) 0.5 * sum((e - t)^2).
function loss(model, data) {
  const w = model.get('w');
  const b = model.get('b')[0];
  let sum = 0;
  for (let i = 0; i < SAMPLES; i++) {
    let p = b;
    for (let j = 0; j < FEATURES; j++) p += data.x[i * FEATURES + j] * w[j];
    sum += (p - data.y[i]) ** 2;
  }
  let total = sum / SAMPLES;
  const e = model.get(BIG_NAME);
  if (e) {
    let s = 0;
    for (let i = 0; i < e.length; i++) s += (e[i] - bigTarget(i)) ** 2;
    total += 0.5 * s;
  }
  return total;
}

// The gradient of this worker's loss on batch `step`: the mean over the batch (SPEC.md section 8).
function gradient(model, data, step, grads) {
  const w = model.get('w');
  const b = model.get('b')[0];
  const gw = grads.get('w').fill(0);
  let gb = 0;
  for (let n = 0; n < BATCH; n++) {
    const i = ((step - 1) * BATCH + n) % SAMPLES;
    let p = b;
    for (let j = 0; j < FEATURES; j++) p += data.x[i * FEATURES + j] * w[j];
    const r = (2 * (p - data.y[i])) / BATCH;
    for (let j = 0; j < FEATURES; j++) gw[j] += r * data.x[i * FEATURES + j];
    gb += r;
  }
  grads.get('b')[0] = gb;
  const e = model.get(BIG_NAME);
  if (e) {
    const ge = grads.get(BIG_NAME);
    for (let i = 0; i < e.length; i++) ge[i] = e[i] - bigTarget(i);
  }
}

function sha256(values) {
  return crypto.createHash('sha256').update(DTYPES.float32.encode(values)).digest('hex');
}

// -- main -----------------------------------------------------------------------------------------------------

async function main() {
  const args = parseArgs(process.argv.slice(2));
  const worker = new Worker(args);
  let exitCode = 0;
  try {
    await worker.connect();
    await worker.join();
    const tensors = makeModel(args.big);
    worker.bind(tensors);
    if (args.badDigest) {
      const results = await worker.badDigest();
      console.log(JSON.stringify({ bad_digest: results, digest: worker.digest }));
      return;
    }
    const init = await Promise.all(worker.addresses.map((_, k) => worker.initShard(k)));
    await worker.pullAll(); // the weights actually held, each shard's version and incarnation
    const model = worker.weights();
    const data = makeData();
    const initialLoss = loss(model, data);
    const grads = new Map(tensors.map((t) => [t.name, new Float32Array(t.data.length)]));
    let versions = worker.versions.slice();
    for (let step = 1; step <= args.steps; step++) {
      gradient(model, data, step, grads);
      versions = await worker.step(grads, step);
    }
    const finalLoss = loss(model, data);
    const small = {};
    const hashes = {};
    for (const t of tensors) {
      if (t.data.length <= 4096) small[t.name] = Array.from(t.data);
      hashes[t.name] = sha256(t.data);
    }
    console.log(
      JSON.stringify({
        initial_loss: initialLoss,
        final_loss: finalLoss,
        steps: args.steps,
        final_version: Math.min(...versions),
        versions,
        digest: worker.digest,
        rank: worker.rank,
        world_size: worker.worldSize,
        mode: worker.topology.job.mode,
        dtype: args.dtype,
        init,
        transport: worker.addresses.map((_, k) => (worker.inline(k) ? 'inline' : 'streams')),
        shard_elements: worker.shards.map(shardElements),
        stats: worker.stats,
        weights: small,
        weights_sha256: hashes,
      }),
    );
  } catch (err) {
    console.error(`train.js: ${err.stack || err}`);
    exitCode = 1;
  } finally {
    try {
      await worker.leave();
    } finally {
      worker.close();
    }
  }
  process.exitCode = exitCode;
}

if (require.main === module) main();

module.exports = { DTYPES, toBfloat16, toFloat16, fromFloat16, chunksOf, Receiver };
