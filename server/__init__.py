"""The ckpt-engine daemon (installed as ``ckpt_engine.server``): HTTP + ZMQ control plane, controller,
history store and rendezvous. It is a thin shell over the library; it holds no tensor code."""
