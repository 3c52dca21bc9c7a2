"""The `specdecode` subcommands whose code is the library itself (generate, models, pull,
certify, env): each module holds one command's flags and its run. The others live beside their
code: `bench` and `plan` in `specdecode.bench`, `serve` in `specdecode.server.cli`, `train` in
`specdecode.train.cli`; `specdecode.cli` only registers them all and dispatches."""
