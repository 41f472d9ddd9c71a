"""The on-disk format, as pure logic: file names, the safetensors container and where items go
in it, the two Parquet tables, the manifest document, checksums, the byte-grouped codec, and the
checks of all of it as hostile input. Nothing here opens a file by name: readers are handed a
store (``storage``) and bytes."""
