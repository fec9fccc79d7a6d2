"""The persistent prefix cache: full KV blocks kept on disk across restarts.

``block_file`` is the on-disk format of one block (header, payload, CRC-32),
``identity`` names the model a block belongs to, ``store`` owns a directory of block
files (atomic writes, size bound, LRU eviction, shared by processes), ``writer`` is
the background thread that writes them, and ``tier`` connects the store to the KV pool
and the block manager (snapshot a block on eviction, load a block on a miss).
"""
