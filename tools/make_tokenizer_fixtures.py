#!/usr/bin/env python3
"""Writes the tokenizer fixtures into tests/data/tokenizer/ (see tools/README.md, "Tokenizer fixtures").

  corpus.txt                  >= 10,000 records, one per line, escaped (\\n newline, \\r CR, \\\\ backslash)
  <name>.json                 small byte-level BPE tokenizers trained here with `tokenizers`
  <name>.ids.txt              ids of every record, from Tokenizer.encode(record, add_special_tokens=False)
  manifest.json               versions, sha256 of every file, per-tokenizer coverage counts

glm5_tiny_kjv.ids.txt is written too when models/glm5-tiny-kjv/tokenizer.json exists; the manifest keeps the
sha256 of the tokenizer.json it came from.

Everything is deterministic: the corpus comes from a fixed seed, the KJV text (Debian package bible-kjv) and the
literal lists below; training runs single-threaded.
"""

import argparse
import hashlib
import json
import os
import random
import re
import shutil
import subprocess
import sys
from pathlib import Path

# Single-threaded training and encoding; must be set before tokenizers is imported.
os.environ["RAYON_NUM_THREADS"] = "1"
os.environ["TOKENIZERS_PARALLELISM"] = "false"

import tokenizers  # noqa: E402
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers  # noqa: E402
from tokenizers import pre_tokenizers, trainers  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
SEED = 20250611

# ---- pre-tokenizer specs -------------------------------------------------------------------------

# GLM-5's split regex (Split, Isolated), followed by ByteLevel without its own regex.
GLM5_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
                r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
GLM5_SPECIALS = ["[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>",
                 "<|endoftext|>", "<think>", "</think>"]

# DeepSeek-V3 (deepseek-ai/DeepSeek-V3 tokenizer.json): three isolating Splits, then ByteLevel.
DEEPSEEK_PATTERNS = [
    r"\p{N}{1,3}",
    "[一-龥\u3040-ゟ゠-ヿ]+",
    "[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|[^\r\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+|"
    " ?[\\p{P}\\p{S}]+[\r\n]*|\\s*[\r\n]+|\\s+(?!\\S)|\\s+",
]
DEEPSEEK_SPECIALS = ["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>"]
# Extra added tokens exercising the AddedToken options (not in the real DeepSeek-V3 file).
DEEPSEEK_EXTRA = [
    AddedToken("<｜tool▁sep｜>", special=True, lstrip=True, rstrip=True, normalized=False),
    AddedToken("[[mask]]", special=False, single_word=True, normalized=True),
    AddedToken("colibri", special=False, single_word=True, normalized=True),
    AddedToken("<tab>", special=False, lstrip=True, normalized=False),
]

# NFC + individual digits + ByteLevel with GPT-2's regex and a prefix space (command-r / older Qwen shape).
NFC_SPECIALS = ["<|im_start|>", "<|im_end|>"]
NFC_EXTRA = [
    AddedToken("café", special=False, normalized=True),        # matches NFC and NFD spellings
    AddedToken("<|sep|>", special=True, rstrip=True, normalized=False),
]

# With ignore_merges, these pieces are single vocabulary entries (prefix space from add_prefix_space).
IGNORE_MERGES_WORDS = [" firmament", " Methuselah", " Nebuchadnezzar", " colibri", " hummingbird"]

# ---- corpus ----------------------------------------------------------------------------------------

SENTENCES = {
    "zh": ["今天天气很好，我们去公园散步吧。", "人工智能正在改变世界。", "这是一个用于测试分词器的句子。",
           "北京是中国的首都，有三千多年的历史。", "他说：“我明天再来。”", "数学、物理和化学都是自然科学。",
           "请把窗户打开，屋里太热了。", "春眠不觉晓，处处闻啼鸟。", "混合专家模型把计算分给不同的专家。",
           "我们在第3章讨论了2024年的结果。"],
    "ja": ["今日はいい天気ですね。", "私はコーヒーが好きです。", "東京タワーは高いです。",
           "カタカナとひらがなを混ぜて書きます。", "ソフトウェアエンジニアとして働いています。",
           "吾輩は猫である。名前はまだ無い。", "ｶﾀｶﾅの半角もあります。", "ゟとヿは珍しい文字です。"],
    "ko": ["안녕하세요, 만나서 반갑습니다.", "한국어는 한글로 씁니다.", "오늘 날씨가 정말 좋네요.",
           "서울은 대한민국의 수도입니다."],
    "ru": ["Привет, как дела?", "Москва — столица России.", "Съешь же ещё этих мягких французских булок, да выпей чаю.",
           "Я люблю программировать на C++.", "В 1961 году Гагарин полетел в космос."],
    "uk": ["Слава Україні! Київ — місто каштанів.", "Ґанок і їжак з'їли все."],
    "ar": ["مرحبا بالعالم", "اللغة العربية جميلة جدا.", "أين المكتبة؟", "السلام عليكم ورحمة الله.",
           "عدد السكان ١٢٣٤٥٦ نسمة."],
    "he": ["שלום עולם", "אני אוהב ללמוד שפות."],
    "hi": ["नमस्ते दुनिया", "मुझे हिंदी पढ़ना पसंद है।", "भारत एक विशाल देश है।", "संस्कृत एक प्राचीन भाषा है।",
           "वर्ष २०२४ में १२ महीने हैं।"],
    "el": ["Γειά σου Κόσμε!", "Η Αθήνα είναι η πρωτεύουσα της Ελλάδας.", "Ἐν ἀρχῇ ἦν ὁ λόγος.",
           "Τα μαθηματικά: α + β = γ."],
    "th": ["สวัสดีครับ ยินดีที่ได้รู้จัก", "ภาษาไทยไม่มีช่องว่างระหว่างคำ"],
    "vi": ["Tiếng Việt có nhiều dấu thanh.", "Xin chào các bạn!"],
    "tr": ["İstanbul'da yaşıyorum; ılık bir gün.", "ŞEKER, şeker, ÇOK güzel."],
    "de": ["Größenordnung, Straße, übermäßig – „Anführungszeichen“.", "Die Würde des Menschen ist unantastbar."],
    "fr": ["L'été dernier, j'ai visité Paris à vélo.", "Ça coûte 12,50 € — c'est cher !"],
    "es": ["¿Dónde está la biblioteca? ¡Aquí!", "El niño comió piña."],
    "pl": ["Zażółć gęślą jaźń."],
    "misc": ["Բարեւ աշխարհ", "გამარჯობა მსოფლიო", "வணக்கம் உலகம்", "আমি বাংলায় গান গাই।", "ሰላም ለዓለም",
             "ᠮᠣᠩᠭᠣᠯ ᠪᠢᠴᠢᠭ", "ꦲꦤꦕꦫꦏ", "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 𝕄𝕒𝕥𝕙", "Ｆｕｌｌｗｉｄｔｈ　ｔｅｘｔ！"],
    "math": ["∀x∈ℝ: x² ≥ 0", "∑_{i=1}^{n} i = n(n+1)/2", "E = mc²", "√2 ≈ 1.41421356", "∫₀^∞ e^{-x} dx = 1",
             "A ⊆ B ∧ B ⊆ A ⇒ A = B", "$1,234.56 €99 ¥10000 £5 ₹250 ₩3000"],
}

EMOJI = ["😀", "😂", "🥲", "❤️", "👍", "👍🏻", "👍🏼", "👍🏽", "👍🏾", "👍🏿", "👋🏽", "👨‍👩‍👧‍👦", "👩🏽‍💻",
         "🏳️‍🌈", "🏴‍☠️", "🧑🏾‍🤝‍🧑🏼", "🇯🇵", "🇺🇸", "🇩🇪", "1️⃣", "#️⃣", "©️", "🫠", "🦀", "🐍", "☕", "✨",
         "🎉", "🤷‍♀️", "🙆🏻‍♂️", "👁️‍🗨️", "❤️‍🔥", "🏴󠁧󠁢󠁳󠁣󠁴󠁿"]

CODE_SNIPPETS = [
    '#include <vector>\n\nint sum(const std::vector<int>& v) {\n  int total = 0;\n  for (int x : v) total += x;\n'
    '  return total;\n}\n',
    'template <typename T>\nstruct Span {\n    T* data = nullptr;\n    size_t size = 0;\n\n    T& operator[](size_t i) '
    '{ return data[i]; }\n};\n',
    'int main(int argc, char** argv) {\n\tif (argc < 2) {\n\t\tstd::fprintf(stderr, "usage: %s FILE\\n", argv[0]);\n'
    '\t\treturn 1;\n\t}\n\treturn 0;\n}\n',
    'namespace colibri {\n\n// Returns the index of the largest logit.\ninline int argmax(std::span<const float> x) {\n'
    '  return int(std::max_element(x.begin(), x.end()) - x.begin());\n}\n\n}  // namespace colibri\n',
    'def fib(n):\n    """Return the n-th Fibonacci number."""\n    a, b = 0, 1\n    for _ in range(n):\n'
    '        a, b = b, a + b\n    return a\n',
    'class Tokenizer:\n    def __init__(self, path: str) -> None:\n        self.path = path\n\n'
    '    def encode(self, text: str) -> list[int]:\n        raise NotImplementedError\n',
    'import numpy as np\n\nx = np.arange(12).reshape(3, 4)\nprint(x @ x.T)  # [[ 14  38  62]\n',
    'if __name__ == "__main__":\n    main()\n',
    'for (size_t i = 0; i < n; ++i) {\n    y[i] += alpha * x[i];   // axpy\n}\n',
    'SELECT name, COUNT(*) AS n\nFROM users\nWHERE age >= 18\nGROUP BY name\nORDER BY n DESC;\n',
    '{\n  "model_type": "glm_moe_dsa",\n  "hidden_size": 6144,\n  "n_routed_experts": 256\n}\n',
    'fn main() {\n    let v: Vec<u32> = (0..10).map(|x| x * x).collect();\n    println!("{:?}", v);\n}\n',
    '    indented_four = True\n        indented_eight = [1, 2, 3]\n\t\ttabbed_twice = {"k": "v"}\n',
    '#!/usr/bin/env bash\nset -euo pipefail\nmpirun -np 4 ./colibri-node --model /models/glm5 "$@"\n',
]

CONTRACTIONS = ["I'm", "you're", "he's", "she'll", "we've", "they'd", "don't", "can't", "won't", "isn't", "IT'S",
                "WE'LL", "You'Re", "THEY'VE", "I'D", "it’s", "'s", "'t", "rock'n'roll", "o'clock", "'quoted'", "''",
                "'''", "l'été", "Ma'am", "y'all'd've", "'ſ", "'\u212a", "'S'", "don 't", "' s"]

GLM_CHAT = [
    "[gMASK]<sop><|system|>\nYou are a helpful assistant.<|user|>\nHello!<|assistant|>\n<think>Let me think."
    "</think>\nHi!<|endoftext|>",
    "<|user|>hello", "hello<|user|>", "<|user|><|user|>", "<|user", "<|user|", "<|User|>", "< |user|>",
    "<<|user|>>", "[gMASK][gMASK]", "<think></think>", " <think> ", "</think>\n\n", "<|observation|>{\"result\": 42}",
    "<|assistant|>\n<think>\n\n</think>\n\nThe answer is 4.", "[gMASK]<sop>", "<sop>x<sop>", "text<|endoftext|>text",
]
DEEPSEEK_CHAT = [
    "<｜begin▁of▁sentence｜><｜User｜>What is 2+2?<｜Assistant｜>4<｜end▁of▁sentence｜>", "<｜User｜>hi",
    "<｜User|>", "<｜Assistant｜><think>\n</think>", "x <｜tool▁sep｜>  y", "x<｜tool▁sep｜>\n\ny", "  <｜tool▁sep｜>",
    "a [[mask]] b", "a[[mask]]b", "[[mask]]", "[[mask]], [[mask]].", "é[[mask]]", "colibri colibris Colibri colibri_node",
    "the colibri, a colibri-node", "x<tab>y", "x   <tab>y", "\t<tab>\t",
]
NFC_CHAT = [
    "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n", "a café, a cafe\u0301, a CAFÉ", "cafécafé",
    "x<|sep|>   y", "<|sep|><|sep|>", "<|im_start|><|im_end|>",
]

NFD_TEXT = ["e\u0301", "Cafe\u0301 de\u0301ja\u0300 vu", "A\u030angstro\u0308m", "\u1100\u1161\u11a8 \u1112\u1161\u11ab",
            "o\u0308\u0304", "\u212b", "\u2126hm", "n\u0303", "Ä and A\u0308", "ﬁ ligature", "Ǆ", "\u0958\u0959"]

WHITESPACE_CHARS = [" ", "\t", "\n", "\r\n", "\u00a0", "\u3000", "\u2028", "\u180e", "\u0085", "\u200b", "\x0b", "\x0c",
                    "\x1c", "\u2003", "\u202f"]


def kjv_verses():
    if not shutil.which("bible"):
        sys.exit("make_tokenizer_fixtures: the `bible` program is missing (Debian packages bible-kjv, bible-kjv-text)")
    text = subprocess.run(["bible", "-l100000", "Gen1:1-Rev22:21"], check=True, capture_output=True,
                          text=True).stdout
    verses = []
    chapter = ""
    for line in text.split("\n"):
        m = re.match(r"^\s+(\d+) (.*)$", line)
        if m:
            verses.append((chapter, int(m.group(1)), m.group(2)))
        elif line.strip():
            chapter = line.strip()
    return verses


def random_number(rng):
    kind = rng.randrange(16)
    if kind == 0:
        return "".join(rng.choice("0123456789") for _ in range(rng.randint(8, 60)))
    if kind == 1:
        return f"{rng.randint(0, 10**9):,}"
    if kind == 2:
        return f"{rng.uniform(-1000, 1000):.{rng.randint(1, 8)}f}"
    if kind == 3:
        return f"{rng.uniform(1, 10):.3f}e{rng.randint(-30, 30)}"
    if kind == 4:
        return f"0x{rng.randrange(1 << 32):08X}"
    if kind == 5:
        return f"{rng.randint(1900, 2100)}-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}"
    if kind == 6:
        return f"{rng.randint(0, 23):02d}:{rng.randint(0, 59):02d}:{rng.randint(0, 59):02d}"
    if kind == 7:
        return f"v{rng.randint(0, 9)}.{rng.randint(0, 20)}.{rng.randint(0, 99)}"
    if kind == 8:
        return f"+1 ({rng.randint(200, 999)}) {rng.randint(100, 999)}-{rng.randint(1000, 9999)}"
    if kind == 9:
        return "".join(rng.choice("٠١٢٣٤٥٦٧٨٩") for _ in range(rng.randint(1, 8)))
    if kind == 10:
        return "".join(rng.choice("०१२३४५६७८९") for _ in range(rng.randint(1, 8)))
    if kind == 11:
        return "".join(rng.choice("０１２３４５６７８９") for _ in range(rng.randint(1, 8)))
    if kind == 12:
        return rng.choice(["²³¹", "½ ¾", "Ⅻ", "ⅷ", "①②③", "⁴²", "₀₁₂"])
    if kind == 13:
        return ".".join(str(rng.randint(0, 255)) for _ in range(4))
    if kind == 14:
        return str(rng.randint(0, 10**rng.randint(1, 6)))
    return f"-{rng.randint(1, 99999)}"


def make_corpus():
    rng = random.Random(SEED)
    verses = kjv_verses()
    all_sentences = [s for group in SENTENCES.values() for s in group]
    chats = GLM_CHAT + DEEPSEEK_CHAT + NFC_CHAT
    records = []

    picked = sorted(rng.sample(range(len(verses)), 1700))
    for i in picked:
        records.append(verses[i][2])
    for _ in range(150):  # with references, as `bible` prints them
        chapter, number, text = rng.choice(verses)
        records.append(f"{chapter}:{number} {text}")
    for _ in range(50):
        records.append(rng.choice(verses)[2].upper())
    for _ in range(50):
        records.append(rng.choice(verses)[2] + "\r\n" + rng.choice(verses)[2] + "\r\n")
    for _ in range(50):
        records.append(" " * rng.randint(1, 6) + rng.choice(verses)[2] + " " * rng.randint(1, 6))

    for _ in range(800):
        n = rng.randint(1, 3)
        parts = [rng.choice(all_sentences) for _ in range(n)]
        if rng.random() < 0.3:
            parts.insert(rng.randrange(n + 1), random_number(rng))
        records.append(rng.choice([" ", "", "\n"]).join(parts))
    for group in SENTENCES.values():
        records.extend(group)

    for _ in range(450):
        words = rng.sample(all_sentences, 1)[0].split(" ")
        for _ in range(rng.randint(1, 4)):
            words.insert(rng.randrange(len(words) + 1), "".join(rng.choice(EMOJI) for _ in range(rng.randint(1, 3))))
        records.append(" ".join(words))
    records.extend(EMOJI)

    for snippet in CODE_SNIPPETS:
        records.append(snippet)
        records.extend(line for line in snippet.split("\n") if line)
    for _ in range(450):
        snippet = rng.choice(CODE_SNIPPETS).split("\n")
        a = rng.randrange(len(snippet))
        b = min(len(snippet), a + rng.randint(1, 6))
        text = "\n".join(snippet[a:b])
        if rng.random() < 0.3:
            text = text.replace("\n", "\r\n")
        if rng.random() < 0.3:
            text = text.replace("    ", "\t")
        records.append(text)

    for _ in range(1000):
        kind = rng.randrange(8)
        if kind == 0:
            records.append(" " * rng.randint(1, 120))
        elif kind == 1:
            records.append("\t" * rng.randint(1, 20))
        elif kind == 2:
            records.append("word" + " " * rng.randint(1, 80) + "word" + "\t" * rng.randint(0, 5) + "end")
        elif kind == 3:
            records.append("\n" * rng.randint(1, 12))
        elif kind == 4:
            records.append("\r\n".join(rng.choice(all_sentences) for _ in range(rng.randint(1, 4))) + "\r\n")
        elif kind == 5:
            records.append("\n\n" + rng.choice(all_sentences) + "\n\n\n" + rng.choice(all_sentences) + "\n")
        elif kind == 6:
            records.append("".join(rng.choice(WHITESPACE_CHARS) + rng.choice(["a", "Б", "中", "1", "!", "", ""])
                                   for _ in range(rng.randint(1, 12))))
        else:
            records.append(" " * rng.randint(0, 8) + rng.choice(all_sentences) + " " * rng.randint(0, 8))
    records.extend(WHITESPACE_CHARS)
    records.append("")

    for _ in range(1900):
        template = rng.choice(["The total is {} units.", "{}", "{} + {} = {}", "call {} now", "Price: {}",
                               "ids {},{},{}", "x={}", "({})", "{}%"])
        records.append(template.format(*(random_number(rng) for _ in range(template.count("{}")))))

    for _ in range(800):
        words = [rng.choice(CONTRACTIONS) for _ in range(rng.randint(1, 4))]
        records.append(" ".join(words) + rng.choice(["", ".", "!", " ok", "?"]))
    records.extend(CONTRACTIONS)

    for _ in range(900):
        parts = [rng.choice(chats)]
        if rng.random() < 0.6:
            parts.append(rng.choice(all_sentences + [v[2] for v in rng.sample(verses, 2)]))
        if rng.random() < 0.4:
            parts.insert(0, rng.choice(chats))
        rng.shuffle(parts)
        records.append(rng.choice(["", " ", "\n"]).join(parts))
    records.extend(chats)

    for _ in range(150):
        records.append(" ".join(rng.choice(NFD_TEXT) for _ in range(rng.randint(1, 4))))
    records.extend(NFD_TEXT)

    pools = [all_sentences, EMOJI, CONTRACTIONS, chats, NFD_TEXT, [v[2] for v in verses[:2000]],
             [line for s in CODE_SNIPPETS for line in s.split("\n")]]
    for _ in range(1100):
        pieces = []
        for _ in range(rng.randint(2, 4)):
            pool = rng.choice(pools)
            pieces.append(rng.choice(pool) if rng.random() < 0.85 else random_number(rng))
        seps = [" ", "", "\n", "  ", "\t", ", ", "\r\n", "\n\n", " \n "]
        records.append("".join(p + rng.choice(seps) for p in pieces))

    words = sorted({w for s in all_sentences + CONTRACTIONS + EMOJI for w in s.split(" ") if w})
    for _ in range(400):  # single words and characters
        word = rng.choice(words)
        records.append(word if rng.random() < 0.7 else rng.choice(word))

    records.append("x" * 3000)                # one long piece, beyond the C++ piece cache
    records.append("ab" * 1500)
    records.append(" " * 5000 + "x")
    records.append("1" * 2000)
    return records


def escape(record):
    return record.replace("\\", "\\\\").replace("\n", "\\n").replace("\r", "\\r")


# ---- tokenizers ----------------------------------------------------------------------------------


def _gpt2_bytes():
    return list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))


def _gpt2_chars():
    """GPT-2's byte -> printable character map, as values in byte order."""
    printable = set(_gpt2_bytes())
    chars, n = [], 0
    for b in range(256):
        if b in printable:
            chars.append(chr(b))
        else:
            chars.append(chr(256 + n))
            n += 1
    return chars


def train(pre_tokenizer, normalizer, vocab_size, trainer_specials, texts):
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizer
    tok.pre_tokenizer = pre_tokenizer
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, show_progress=False,
                                  special_tokens=[AddedToken(s, special=True, normalized=False)
                                                  for s in trainer_specials],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def set_model_fields(tok, merges_as_strings=False, ignore_merges=None, extra_words=()):
    spec = json.loads(tok.to_str())
    if ignore_merges is not None:
        spec["model"]["ignore_merges"] = ignore_merges
    # Vocabulary entries no merge sequence builds: only ignore_merges produces them.
    next_id = 1 + max(list(spec["model"]["vocab"].values()) + [t["id"] for t in spec["added_tokens"]])
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    byte_to_char = dict(enumerate(_gpt2_chars()))
    for word in extra_words:
        token = "".join(byte_to_char[b] for b in word.encode("utf-8"))
        assert all(c in alphabet for c in token), word
        if token in spec["model"]["vocab"]:
            continue
        spec["model"]["vocab"][token] = next_id
        next_id += 1
    if merges_as_strings:
        spec["model"]["merges"] = [" ".join(m) if isinstance(m, list) else m for m in spec["model"]["merges"]]
    return Tokenizer.from_str(json.dumps(spec, ensure_ascii=False))


def build_tokenizers(records):
    train_texts = records[::2]  # every other record
    glm = train(pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(GLM5_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]), None, 3000, [], train_texts)
    # As in GLM-5, the special tokens come after the model vocabulary.
    glm.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in GLM5_SPECIALS])

    ds = train(pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(p), behavior="isolated", invert=False) for p in DEEPSEEK_PATTERNS] +
        [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]), None, 3000, DEEPSEEK_SPECIALS,
        train_texts)
    ds.add_tokens(DEEPSEEK_EXTRA)
    ds = set_model_fields(ds, merges_as_strings=True)

    nfc = train(pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=True, use_regex=True)]), normalizers.NFC(), 2000, NFC_SPECIALS,
        train_texts)
    # Extra vocabulary entries first: the library renumbers added tokens that are not in the vocabulary to
    # follow it when it loads a file.
    nfc = set_model_fields(nfc, ignore_merges=True, extra_words=IGNORE_MERGES_WORDS)
    nfc.add_tokens(NFC_EXTRA)
    return {"glm5_style": glm, "deepseek_v3_style": ds, "nfc_digits_style": nfc}


# Pre-tokenizer configurations beyond the three tokenizers, on one small vocabulary whose merges cross
# the split points, so that every way of cutting a text shows in the ids.
CASE_TEXTS = ["a-b--c - d", "-lead trail-", "--", "x1234y 56 7", "hello world  foo\n\nbar", "é-1-é",
              "Hi <|x|> there", "a  b", " leading space", "ab--ab", "a\u180eb\u3000c\u0085d"]
CASE_PRE_TOKENIZERS = {
    f"split_{behavior}{'_invert' if invert else ''}": pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(r"-+|\s"), behavior=behavior, invert=invert),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    for behavior in ["removed", "isolated", "merged_with_previous", "merged_with_next", "contiguous"]
    for invert in [False, True]
}
CASE_PRE_TOKENIZERS.update({
    "split_string_isolated": pre_tokenizers.Sequence([
        pre_tokenizers.Split("-", behavior="isolated"), pre_tokenizers.ByteLevel(add_prefix_space=False,
                                                                                  use_regex=False)]),
    "split_string_merged_with_next": pre_tokenizers.Sequence([
        pre_tokenizers.Split("--", behavior="merged_with_next"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]),
    "digits_contiguous": pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=False), pre_tokenizers.ByteLevel(add_prefix_space=False,
                                                                                  use_regex=False)]),
    "byte_level_regex": pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    "byte_level_prefix_regex": pre_tokenizers.ByteLevel(add_prefix_space=True, use_regex=True),
    "byte_level_prefix_only": pre_tokenizers.ByteLevel(add_prefix_space=True, use_regex=False),
    "nested_sequence": pre_tokenizers.Sequence([
        pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(r"\s+"), behavior="removed"),
                                 pre_tokenizers.Digits(individual_digits=True)]),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]),
    "onig_escapes": pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(r"\w+|\h+|\S"), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]),
})


def make_cases():
    base = train(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False), None, 400, ["<|x|>"],
                 CASE_TEXTS * 3 + [t.upper() for t in CASE_TEXTS])
    cases = []
    for name, pre in CASE_PRE_TOKENIZERS.items():
        base.pre_tokenizer = pre
        spec = json.loads(base.to_str())
        cases.append({"name": name, "pre_tokenizer": spec["pre_tokenizer"], "texts": CASE_TEXTS,
                      "ids": [e.ids for e in base.encode_batch(CASE_TEXTS, add_special_tokens=False)]})
    base.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    return {"base": json.loads(base.to_str()), "cases": cases, "model_cases": make_model_cases()}


def make_model_cases():
    """BPE options the trained tokenizers do not use: unk_token (fused or not) for bytes without a
    token, bytes silently dropped when there is no unk_token, and a merge listed twice (its last
    rank counts)."""
    vocab = {"a": 0, "b": 1, "ab": 2, "<unk>": 3, "c": 4, "abc": 5, "bc": 6}
    merges = [("a", "b"), ("ab", "c")]
    texts = ["abxxab", "xabcx", "éab", "cab  c", "zzz", "abc"]
    cases = []
    for name, kwargs in [("unk_fused", {"unk_token": "<unk>", "fuse_unk": True}),
                         ("unk_not_fused", {"unk_token": "<unk>", "fuse_unk": False}),
                         ("no_unk_drops_bytes", {}),
                         ("duplicate_merge", {"merges": [("a", "b"), ("b", "c"), ("a", "b")]})]:
        kwargs = {"merges": merges, **kwargs}
        tok = Tokenizer(models.BPE(vocab=vocab, **kwargs))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        tok.decoder = decoders.ByteLevel()
        cases.append({"name": name, "tokenizer": json.loads(tok.to_str()), "texts": texts,
                      "ids": [e.ids for e in tok.encode_batch(texts, add_special_tokens=False)]})
    return cases


def make_special_cases(built):
    """Ids with special tokens left as text (the library's encode_special_tokens, colibri's
    parse_special=false)."""
    texts = GLM_CHAT + DEEPSEEK_CHAT + NFC_CHAT
    cases = []
    for name, tok in built.items():
        tok.encode_special_tokens = True
        cases.append({"tokenizer": name, "texts": texts,
                      "ids": [e.ids for e in tok.encode_batch(texts, add_special_tokens=False)]})
        tok.encode_special_tokens = False
    return cases


def encode_all(tok, records):
    return [e.ids for e in tok.encode_batch(records, add_special_tokens=False)]


def sha256(path):
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def fnv1a64(path):
    """FNV-1a 64 of a file: the C++ test recognises the tiny KJV tokenizer.json with it."""
    h = 0xCBF29CE484222325
    for b in Path(path).read_bytes():
        h = ((h ^ b) * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return f"{h:016x}"


def write_ids(path, all_ids):
    with open(path, "w", encoding="ascii", newline="\n") as f:
        for ids in all_ids:
            f.write(" ".join(map(str, ids)) + "\n")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "tests/data/tokenizer")
    parser.add_argument("--models", type=Path, default=ROOT / "models",
                        help="where glm5-tiny-kjv/tokenizer.json is looked for")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)

    records = make_corpus()
    corpus_path = args.out / "corpus.txt"
    with open(corpus_path, "w", encoding="utf-8", newline="\n") as f:
        for r in records:
            f.write(escape(r) + "\n")
    print(f"corpus.txt: {len(records)} records, {corpus_path.stat().st_size} bytes")

    manifest = {
        "tokenizers_version": tokenizers.__version__,
        "python": sys.version.split()[0],
        "seed": SEED,
        "records": len(records),
        "corpus_sha256": sha256(corpus_path),
        "tokenizers": {},
    }
    for name, tok in build_tokenizers(records).items():
        json_path = args.out / f"{name}.json"
        tok.save(str(json_path), pretty=False)
        tok = Tokenizer.from_file(str(json_path))
        all_ids = encode_all(tok, records)
        ids_path = args.out / f"{name}.ids.txt"
        write_ids(ids_path, all_ids)
        entry = {"json_sha256": sha256(json_path), "ids_sha256": sha256(ids_path),
                 "vocab_size": tok.get_vocab_size(), "tokens": sum(map(len, all_ids))}
        spec = json.loads(json_path.read_text(encoding="utf-8"))
        if spec["normalizer"] is None:
            # Round trip, except where an lstrip/rstrip token took whitespace with it.
            strip_ids = {t["id"] for t in spec["added_tokens"] if t["lstrip"] or t["rstrip"]}
            bad = [i for i, (r, ids) in enumerate(zip(records, all_ids))
                   if not strip_ids.intersection(ids) and tok.decode(ids, skip_special_tokens=False) != r]
            assert not bad, f"{name}: decode(encode(x)) != x for records {bad[:10]}"
        if spec["model"].get("ignore_merges"):
            # How many records ignore_merges changes: the C++ test must see that path taken.
            spec["model"]["ignore_merges"] = False
            plain = Tokenizer.from_str(json.dumps(spec))
            entry["records_changed_by_ignore_merges"] = sum(
                a != b for a, b in zip(all_ids, encode_all(plain, records)))
        manifest["tokenizers"][name] = entry
        print(f"{name}: {json_path.stat().st_size} + {ids_path.stat().st_size} bytes, {entry}")

    cases = make_cases()
    cases["special_cases"] = make_special_cases(
        {name: Tokenizer.from_file(str(args.out / f"{name}.json")) for name in manifest["tokenizers"]})
    with open(args.out / "pre_tokenizer_cases.json", "w", encoding="utf-8") as f:
        json.dump(cases, f, ensure_ascii=False)
        f.write("\n")
    manifest["pre_tokenizer_cases_sha256"] = sha256(args.out / "pre_tokenizer_cases.json")

    tiny = args.models / "glm5-tiny-kjv" / "tokenizer.json"
    if tiny.exists():
        tok = Tokenizer.from_file(str(tiny))
        all_ids = encode_all(tok, records)
        ids_path = args.out / "glm5_tiny_kjv.ids.txt"
        write_ids(ids_path, all_ids)
        manifest["tokenizers"]["glm5_tiny_kjv"] = {
            "json": "models/glm5-tiny-kjv/tokenizer.json", "json_sha256": sha256(tiny), "json_fnv1a64": fnv1a64(tiny),
            "ids_sha256": sha256(ids_path), "vocab_size": tok.get_vocab_size(), "tokens": sum(map(len, all_ids))}
        print(f"glm5_tiny_kjv: {ids_path.stat().st_size} bytes")
    else:
        print(f"{tiny} not found: no glm5_tiny_kjv ids (the C++ test skips it)")

    (args.out / "manifest.json").write_text(json.dumps(manifest, indent=2, ensure_ascii=False) + "\n",
                                            encoding="utf-8")
    total = sum(p.stat().st_size for p in args.out.iterdir())
    print(f"{args.out}: {total} bytes in all")


if __name__ == "__main__":
    main()
