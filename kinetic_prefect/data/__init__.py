"""`Data`: content hashing, the data cache, uploads, and resolution in the pod."""
