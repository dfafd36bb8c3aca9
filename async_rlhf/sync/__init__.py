"""Versioned weight push from learner rank 0 to every generator (docs/architecture.md, "Weight push").

    layout.py        which tensor goes where in which bucket (pure; plain-data wire form, digest)
    protocol.py      the control plane: store keys and messages for join, rebuild, push, ack (drawn there)
    group.py         stores, one process group per membership epoch, waits bounded by deadlines
    transport.py     the data plane behind one interface (sync.backend): gloo (CPU) or nccl (vLLM's PyNccl, GPU)
    tensors.py       byte views shared by both sides; flatten_params for zero-copy sending
    sender.py        Sender (learner rank 0): form, drop, push -> PushError naming who failed
    send_staging.py  the sender's cut of the arena into broadcasts, and its packing slots
    receiver.py      Receiver (a generator's vLLM worker): join, receive(load) -> Received
    receive_slots.py the receiver's 1-2 arenas and their states (free, staged, applying)
"""
