"""The engine in a process of its own (`canvas serve --engine-process`): the serving process
keeps a proxy of the engine (`client.RemoteEngine`, an `engine.types.EngineClient`) and the
spawned engine process runs `engine.async_engine.AsyncEngine`'s step loop (`core`), so the
HTTP front end and the step loop never wait on one interpreter lock. What crosses the pipe is
defined in `messages`; spawning, receiving and stopping a child over a pipe in `pipes` (shared
with the ranks of a parallel model, `engine.parallel.ranks`)."""
