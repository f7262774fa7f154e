"""Built-in calibration and held-out texts (multilingual: English, Chinese,
mixed, numbers). The two sets share no text, so the accuracy report measures
on inputs the calibration never saw."""

from __future__ import annotations

CALIBRATION_TEXTS: tuple[str, ...] = (
    "The quick brown fox jumps over the lazy dog.",
    "今天天气很好，我们一起去公园散步吧。",
    "Please turn on the kitchen lights at 7:30 tomorrow morning.",
    "我的电话号码是 138 0013 8000，请记下来。",
    "Meeting at 3 PM with the CosyVoice team 关于语音合成的讨论。",
    "The temperature dropped to minus 12 degrees, 2 days in a row.",
    "欢迎使用智能语音助手，有什么可以帮您？",
    "Order number 45817 has shipped and will arrive on Friday.",
    "这个周末我想去北京看看长城和故宫。",
    "Set a timer for 25 minutes, then remind me to call Mom.",
    "人工智能正在改变我们的生活方式 and the way we work.",
    "She paid $1,299.99 for the new laptop last week.",
    "请在下一个路口右转，然后直行 500 米。",
    "Reading books every evening helps me sleep better.",
    "第 3 章讲的是 2024 年的经济形势。",
    "Hello! How are you doing today? I hope everything is fine.",
)

HELD_OUT_TEXTS: tuple[str, ...] = (
    "The train to Boston leaves from platform 9 at 6:45.",
    "明天下午三点在会议室开会，请准时参加。",
    "Volume up to 80 percent 然后播放下一首歌。",
    "A journey of a thousand miles begins with a single step.",
    "我们的航班号是 CA 1234，预计晚上 8 点到达。",
    "Dinner is ready, please wash your hands first.",
)


def calibration_texts(size: int) -> list[str]:
    """The first `size` calibration texts, cycling with a numbered suffix when
    more are asked for than are built in."""
    if size < 1:
        raise ValueError(f"calibration size must be >= 1, got {size}")
    out = []
    for i in range(size):
        base = CALIBRATION_TEXTS[i % len(CALIBRATION_TEXTS)]
        out.append(base if i < len(CALIBRATION_TEXTS) else f"{base} {i}")
    return out
