"""SGLang's native routes (``/generate`` and the control routes RL frameworks call), with
SGLang's JSON shapes, served by the same engine as the OpenAI routes."""
