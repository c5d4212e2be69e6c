"""kv_store / kv_load: quantize tokens into the paged cache and read them back."""
