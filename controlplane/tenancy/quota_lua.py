"""Lua scripts of the Redis quota store (layout and behaviour in `quota_redis.py`).

One script per event: RESERVE (check and add, atomically), SETTLE (replace a reservation by the
actual usage, once), STATS (read the counters), HEARTBEAT (a router's liveness). Every script
takes the time from Redis `TIME` (one clock for every router; tests may pass a fixed `now` in
ms). RESERVE and STATS start with the sweep, SETTLE ends with it (a settle that arrives before
anyone noticed the expiry still counts): open reservations past their expiry become `expired`
(they stay charged at the reserved amount), entries that left the window are dropped from the
sum, tombstones older than one reservation TTL are trimmed. Each sweep step is bounded per call
(256 expiries, 1,024 window entries); what is left waits for the next call, erring on the side
of charging too much.

Common ARGV: 1 key prefix, 2 now ('' = Redis TIME), 3 tenant id, 4 window ms (0 = unknown: the
sweep leaves the window alone), 5 fixed|sliding, 6 reservation TTL ms. Numbers cross into Redis
commands through `num` (`%.0f`): Lua 5.1 prints large numbers as 1.7e+12 otherwise.
"""

from __future__ import annotations

from controlplane.store.scripts import LUA_NOW

_COMMON = (
    r"""
local P, T = ARGV[1], ARGV[3]
"""
    + LUA_NOW
    + r"""
local K = P .. ':{' .. T .. '}:'
local LOG, AMT, OPEN, DONE = K .. 'log', K .. 'amt', K .. 'open', K .. 'done'
local ACC, STATS = K .. 'acc', K .. 'stats'
local W = tonumber(ARGV[4])
local SLIDING = ARGV[5] == 'sliding'
local TTL = tonumber(ARGV[6])
local function num(x) return string.format('%.0f', x) end
local function sweep()
  local gone = redis.call('ZRANGEBYSCORE', OPEN, '-inf', num(now), 'LIMIT', 0, 256)
  for _, rid in ipairs(gone) do
    redis.call('ZREM', OPEN, rid)
    redis.call('ZADD', DONE, num(now), '-' .. rid)
    redis.call('HINCRBY', STATS, 'expired', 1)
  end
  local old = {}
  if W > 0 and SLIDING then
    old = redis.call('ZRANGEBYSCORE', LOG, '-inf', num(now - W), 'LIMIT', 0, 1024)
  elseif W > 0 then
    old = redis.call('ZRANGEBYSCORE', LOG, '-inf', '(' .. num(now - now % W), 'LIMIT', 0, 1024)
  end
  if #old > 0 then
    local freed = 0
    for _, a in ipairs(redis.call('HMGET', AMT, unpack(old))) do
      if a then freed = freed + tonumber(a) end
    end
    redis.call('ZREM', LOG, unpack(old))
    redis.call('HDEL', AMT, unpack(old))
    redis.call('HINCRBY', ACC, 'sum', num(-freed))
  end
  redis.call('ZREMRANGEBYSCORE', DONE, '-inf', num(now - TTL))
end
local function keep()
  local ttl = num(2 * math.max(W, TTL))
  for _, k in ipairs({LOG, AMT, OPEN, DONE, ACC}) do redis.call('PEXPIRE', k, ttl) end
end
"""
)
# ARGV 7..11: limit, prompt tokens, sequences, max_tokens (0 = none: inject), default cap.
# Reply: {reservation id (0 = refused), reason ('' = admitted, exhausted, too_large),
#         charged (after an admission), reset ms, retry-after ms, max_tokens, amount}
RESERVE = (
    _COMMON
    + r"""
sweep()
local limit, prompt = tonumber(ARGV[7]), tonumber(ARGV[8])
local seqs, maxt, dcap = tonumber(ARGV[9]), tonumber(ARGV[10]), tonumber(ARGV[11])
local charged = tonumber(redis.call('HGET', ACC, 'sum') or '0')
local room = limit - charged
local asked = maxt
if maxt == 0 then asked = 1 end
local need = prompt + seqs * asked
local reason, cap = '', maxt
if need > limit then
  reason = 'too_large'
else
  if maxt == 0 then cap = math.min(dcap, math.floor((room - prompt) / seqs)) end
  if cap < 1 or prompt + seqs * cap > room then reason = 'exhausted' end
end
local reset = 0
if not SLIDING then
  reset = W - now % W
else
  local newest = redis.call('ZREVRANGE', LOG, 0, 0, 'WITHSCORES')
  if #newest > 0 then reset = math.max(0, tonumber(newest[2]) + W - now) end
end
if reason ~= '' then
  redis.call('HINCRBY', STATS, 'rejected', 1)
  local wait = W
  if reason == 'exhausted' then
    if not SLIDING then
      wait = W - now % W
    else
      local es = redis.call('ZRANGE', LOG, 0, 1023, 'WITHSCORES')
      local free = room
      for i = 1, #es, 2 do
        free = free + tonumber(redis.call('HGET', AMT, es[i]) or '0')
        if free >= need then
          wait = math.max(0, tonumber(es[i + 1]) + W - now)
          break
        end
      end
    end
  end
  return {0, reason, charged, reset, wait, 0, 0}
end
local amount = prompt + seqs * cap
local rid = redis.call('HINCRBY', STATS, 'seq', 1)
redis.call('ZADD', LOG, num(now), rid)
redis.call('HSET', AMT, rid, num(amount))
redis.call('HINCRBY', ACC, 'sum', num(amount))
redis.call('ZADD', OPEN, num(now + TTL), rid)
redis.call('HINCRBY', STATS, 'reserved', 1)
keep()
if SLIDING then reset = W end
return {rid, '', charged + amount, reset, 0, cap, amount}
"""
)

# ARGV 7..9: reservation id, used tokens, retry ('1': a deferred settle sent again, whose first
# attempt may have landed: finding it settled is then no duplicate).
# Reply: settled | duplicate | late | unknown
SETTLE = (
    _COMMON
    + r"""
local rid, used = ARGV[7], tonumber(ARGV[8])
local outcome
if redis.call('ZSCORE', OPEN, rid) then
  redis.call('ZREM', OPEN, rid)
  redis.call('ZADD', DONE, num(now), rid)
  local a = redis.call('HGET', AMT, rid)
  if a then
    redis.call('HSET', AMT, rid, num(used))
    redis.call('HINCRBY', ACC, 'sum', num(used - tonumber(a)))
  end
  outcome = 'settled'
elseif redis.call('ZSCORE', DONE, rid) then
  outcome = 'duplicate'
elseif redis.call('ZSCORE', DONE, '-' .. rid) then
  outcome = 'late'
else
  outcome = 'unknown'
end
sweep()
keep()
if outcome == 'duplicate' and ARGV[9] == '1' then return 'settled' end
redis.call('HINCRBY', STATS, outcome, 1)
return outcome
"""
)

# Reply: flat HGETALL of the counters, then 'open' and the open reservations' count, then
# 'charged' and the window's sum.
STATS = (
    _COMMON
    + r"""
sweep()
local out = redis.call('HGETALL', STATS)
out[#out + 1] = 'open'
out[#out + 1] = redis.call('ZCARD', OPEN)
out[#out + 1] = 'charged'
out[#out + 1] = tonumber(redis.call('HGET', ACC, 'sum') or '0')
return out
"""
)

# ARGV: 1 prefix, 2 now, 3 router id, 4 TTL ms (0 = leave). Reply: live routers.
HEARTBEAT = r"""
local K = ARGV[1] .. ':routers'
local now
if ARGV[2] ~= '' then
  now = tonumber(ARGV[2])
else
  local t = redis.call('TIME')
  now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
local ttl = tonumber(ARGV[4])
if ttl > 0 then
  redis.call('ZADD', K, string.format('%.0f', now + ttl), ARGV[3])
  redis.call('PEXPIRE', K, string.format('%.0f', 2 * ttl))
else
  redis.call('ZREM', K, ARGV[3])
end
redis.call('ZREMRANGEBYSCORE', K, '-inf', string.format('%.0f', now))
return redis.call('ZCARD', K)
"""
