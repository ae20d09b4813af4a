"""ragkv.cli: the server-side tools behind the `ragkv` command (index, serve, query, eval,
bench, demo), kept apart from the public face in `ragkv/`.

Each subcommand imports what it needs (torch, FAISS, the server) only when it runs, so
`ragkv --help` and `ragkv query` work on a client-only install. Nothing in the SDK,
the wire types or the LangChain adapters imports this package.
"""
