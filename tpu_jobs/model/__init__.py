"""The model: the transformer, its LM head, meshes and sharding, functional views of its
parameters, and the fixed-shape rows every jitted program takes. Library code: no job
lives here."""
