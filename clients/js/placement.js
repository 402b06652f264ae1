'use strict';
// Placement and model digest of the paramserver wire contract, written from protos/paramserver/v1/SPEC.md
// (sections "Model digest" and "Placement"), not from the Python code. Element counts are BigInts inside, so a
// shape of any size is placed exactly; pieces come out with plain Numbers (exact below 2^53 elements).

const crypto = require('node:crypto');

// Topology.slice_elements when a server sends 0 (SPEC.md, "Model digest", rule 3).
const DEFAULT_SLICE_ELEMENTS = 1048576;

function numel(shape) {
  let n = 1n;
  for (const d of shape) n *= BigInt(d);
  return n; // 1 for a scalar (empty shape)
}

// One JSON string as SPEC.md's canonical JSON writes it: ASCII only, `"` and `\` escaped, the six short escapes,
// every other character outside U+0020..U+007E as \uXXXX (lowercase hex), characters above U+FFFF as the two
// \uXXXX of their UTF-16 surrogate pair.
const SHORT = { '"': '\\"', '\\': '\\\\', '\b': '\\b', '\f': '\\f', '\n': '\\n', '\r': '\\r', '\t': '\\t' };

function jsonString(text) {
  let out = '"';
  // A JS string is UTF-16 already: each code unit (a surrogate half for characters above U+FFFF) is one \uXXXX.
  for (let i = 0; i < text.length; i++) {
    const ch = text[i];
    const unit = text.charCodeAt(i);
    if (SHORT[ch] !== undefined) out += SHORT[ch];
    else if (unit >= 0x20 && unit <= 0x7e) out += ch;
    else out += '\\u' + unit.toString(16).padStart(4, '0');
  }
  return out + '"';
}

function canonicalJson(specs, numShards, sliceElements) {
  const dims = (shape) => shape.map((d) => BigInt(d).toString()).join(',');
  // A buffer's entry ends with "buffer"; a parameter's is just [name, shape].
  const kind = (s) => (s.buffer ? ',"buffer"' : '');
  const tensors = specs.map((s) => '[' + jsonString(s.name) + ',[' + dims(s.shape) + ']' + kind(s) + ']').join(',');
  return `{"v":1,"shards":${BigInt(numShards)},"slice":${BigInt(sliceElements)},"tensors":[${tensors}]}`;
}

// The digest naming a model on `numShards` shards with this slice size: 64 lowercase hex digits.
function digest(specs, numShards, sliceElements = DEFAULT_SLICE_ELEMENTS) {
  return crypto.createHash('sha256').update(canonicalJson(specs, numShards, sliceElements), 'utf8').digest('hex');
}

// Each shard's ordered piece list: [[{name, start, length}, ...], ...] (SPEC.md, "Placement").
function place(specs, numShards, sliceElements = DEFAULT_SLICE_ELEMENTS) {
  if (!(numShards >= 1)) throw new Error(`num_shards must be at least 1, not ${numShards}`);
  const order = new Map();
  specs.forEach((s, i) => {
    if (order.has(s.name)) throw new Error(`tensor names must be unique: ${JSON.stringify(s.name)}`);
    order.set(s.name, i);
  });
  const shards = BigInt(numShards);
  const slice = BigInt(sliceElements);
  const pieces = Array.from({ length: numShards }, () => []);
  const load = new Array(numShards).fill(0n);
  const whole = [];
  for (const s of specs) {
    const n = numel(s.shape);
    if (n > slice && numShards > 1) {
      const step = (n + shards - 1n) / shards; // ceil(n / num_shards), exactly
      for (let k = 0; k < numShards; k++) {
        const start = BigInt(k) * step;
        const rest = n - start;
        const length = rest <= 0n ? 0n : rest < step ? rest : step;
        if (length > 0n) {
          pieces[k].push({ name: s.name, start, length });
          load[k] += length;
        }
      }
    } else {
      whole.push({ spec: s, n });
    }
  }
  // Largest first (ties: model order), each onto the least-loaded shard (ties: lowest index).
  whole.sort((a, b) => (a.n > b.n ? -1 : a.n < b.n ? 1 : order.get(a.spec.name) - order.get(b.spec.name)));
  for (const { spec, n } of whole) {
    let best = 0;
    for (let k = 1; k < numShards; k++) if (load[k] < load[best]) best = k;
    pieces[best].push({ name: spec.name, start: 0n, length: n });
    load[best] += n;
  }
  // Within a shard: model order, then start.
  return pieces.map((ps) =>
    ps
      .sort((a, b) => order.get(a.name) - order.get(b.name) || (a.start < b.start ? -1 : a.start > b.start ? 1 : 0))
      .map((p) => ({ name: p.name, start: Number(p.start), length: Number(p.length) })),
  );
}

function shardElements(pieces) {
  return pieces.reduce((sum, p) => sum + p.length, 0);
}

module.exports = { DEFAULT_SLICE_ELEMENTS, numel, jsonString, canonicalJson, digest, place, shardElements };
