"""What a request's prompt is made of, torch-free and shared by the server and the engine: the
checkpoint's tokenizer and chat template (`tokenizer`) and a client's images, decoded safely
and preprocessed into patches (`images`)."""
