"""The `zipage` command line: one module per subcommand (replay, calibrate, generate, trace,
report, compare, plan, serve, bench), each with `add_parser(commands)` and its handler, sharing
`flags` (flags derived from the knob declarations) and `output` (summaries, exit statuses).
`parser.main` is the entry point; `python -m zipage.cli` runs it too.

This is the top layer: it imports everything below it, and nothing below imports it
(docs/architecture.md, 'Layers').
"""
