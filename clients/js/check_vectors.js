'use strict';
// Check placement.js against the contract's test vectors (protos/paramserver/v1/vectors.json): every case's
// pieces per shard, elements per shard and digest. Exits 1 on any mismatch.
//
//   node check_vectors.js [path/to/vectors.json]

const fs = require('node:fs');
const path = require('node:path');
const { digest, place, shardElements } = require('./placement');

const file = process.argv[2] || path.join(__dirname, '..', '..', 'protos', 'paramserver', 'v1', 'vectors.json');
const cases = JSON.parse(fs.readFileSync(file, 'utf8'));
if (!Array.isArray(cases) || cases.length === 0) {
  console.error(`${file}: no test vectors`);
  process.exit(1);
}

let failed = 0;
for (const [i, c] of cases.entries()) {
  const problems = [];
  const shards = place(c.specs, c.num_shards, c.slice_elements);
  if (JSON.stringify(shards) !== JSON.stringify(c.shards)) {
    problems.push(`pieces: got ${JSON.stringify(shards)}, want ${JSON.stringify(c.shards)}`);
  }
  const elements = shards.map(shardElements);
  if (JSON.stringify(elements) !== JSON.stringify(c.shard_elements)) {
    problems.push(`shard_elements: got ${JSON.stringify(elements)}, want ${JSON.stringify(c.shard_elements)}`);
  }
  const d = digest(c.specs, c.num_shards, c.slice_elements);
  if (d !== c.digest) problems.push(`digest: got ${d}, want ${c.digest}`);
  if (problems.length) {
    failed++;
    console.error(`FAIL case ${i} (${c.case}):\n  ${problems.join('\n  ')}`);
  }
}
console.log(`${cases.length - failed} passed, ${failed} failed`);
process.exit(failed ? 1 : 0);
