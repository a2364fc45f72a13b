"""Weight distribution as lossless compressed deltas (numpy + zstandard; nothing of Megatron or vLLM).

checkpoint  safetensors directories read lazily (bf16/fp8 as bit patterns), written piece by piece
codec       one piece against its previous version: same / sparse / xor / raw, zstd, hashes
device      the same encoding of tensors already on a GPU (torch), compression overlapped
manifest    a version: tensors cut into pieces, where each payload lives, hashes, self-checksum
transports  a local directory, an SSH host (fabric/SFTP) or S3 (boto3), atomic and exclusive writes
store       versions (manifests, published last) + content-addressed chunks; gc
pusher      push_version: encode against the head (or an anchor), upload, publish; TensorPusher: the same from tensors in memory
rebuild     plans along delta chains, chunk fetching, verified rebuilding, verify
receiver    pull into a directory with an atomic swap, or patch it in place; apply_version; relay
"""
