"""The request pipeline every API family runs through once its body is in the common shape: intake (body and
readiness), the one sampling-field reader, the chat plan and its output shaper, the generation of n choices, the
embedding runs and the infill prompt."""
