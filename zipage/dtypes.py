"""The value types a deployment stores its weights and caches in, by the names its flags and
profiles use, and the bytes of one value of each."""

DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
