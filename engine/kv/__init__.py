"""engine.kv: where the engine keeps KV, and the KV tree of conversations over it.

- `cache`: a chunk's stored KV (`ChunkKV`) and a request's decode cache (`KVCache`);
- `pool`: token slots on one device, handed out by index (`KVPool`), which the tree's nodes hold;
- `tree`, `tree_node`, `tree_disk`, `node_files`: the KV tree (a radix tree of token ids and
  KV, in device, host and disk tiers) and its spilled files;
- `conversation`: the tree's door for a request (`Conversations`, `TreeConfig`);
- `retention`: pins and priorities that keep an agent's path ahead of LRU;
- `memory`: the host allocator's tuning for big KV buffers.

The engine's other parts (model, passes, scheduler) sit one folder up.
"""
