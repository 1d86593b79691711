"""A small fixed English corpus for training the tiny models' byte-level BPE tokenizer offline."""

CORPUS = """
The quick brown fox jumps over the lazy dog. A serving system turns one engine into a service
for many users. Requests arrive, wait in a queue, are scheduled into a batch, and the engine runs
one step over the whole batch. Each step computes new tokens for every running sequence.
Once upon a time there was a little robot who wanted to learn how to write poems. Every morning
it read a book, and every evening it wrote a line. The moon was bright and the river was calm.
Hello, world! How are you today? I am fine, thank you. What is the capital of France? Paris is
the capital of France. What is two plus two? Two plus two is four. Please write a short story
about a cat, a dog and a bird who travel together across the mountains to find the sea.
Machine learning models are trained on data. Inference is the process of running a trained model
to make predictions. Large language models generate text one token at a time. The key and value
cache stores the attention state of previous tokens so they need not be computed again.
In 1969, humans first walked on the moon. The speed of light is about 299,792 kilometres per
second. Water boils at 100 degrees Celsius at sea level. Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 100.
def add(a, b):
    return a + b
for i in range(10):
    print(i * i)
{"name": "inferflow", "version": "0.1.0", "tags": ["llm", "serving", "onnx"]}
Système, café, naïve, über, señor, 東京, 北京, こんにちは, 안녕하세요, Привет, مرحبا, 🙂 🚀 ✨.
System: You are a helpful assistant. User: Tell me a joke. Assistant: Why did the scarecrow win
an award? Because he was outstanding in his field.
"""
