"""Lua scripts of the Redis prefix index (the key layout is in `redis_index.py`).

Both scripts take the time from Redis `TIME` (one clock for every router process); tests may pass a
fixed time instead (a non-empty `now` argument). A chain travels as one binary string of 8 bytes
(big-endian u64) per block, so a 2,000-block prompt is one 16 KB argument rather than 2,000
arguments; the scripts cut it into members lazily. Members are those 8-byte strings.

Per replica: `P:c:<r>` SET of confirmed blocks (what lookups read: SMISMEMBER answers integers,
about 3x cheaper per block than reading scores on Redis 7.0), `P:t:<r>` ZSET of the same blocks
scored by expiry (ms; what trimming and the cap read), `P:s:<r>` ZSET of speculative blocks scored
by expiry (read by lookups with ZMSCORE: speculative expiry is exact).
"""

from __future__ import annotations

from controlplane.store.scripts import LUA_NOW

_COMMON = "\nlocal P = ARGV[1]" + LUA_NOW
# ARGV: prefix, now ('' = Redis TIME), chain (8 bytes per block), candidates as one string
# "replica\0incarnation\0replica\0incarnation..." (one argument and one reply string rather than
# 32 integers: redis-py's pure-Python parser costs a few microseconds per element).
# Returns "matched,confirmed,matched,confirmed,..." in candidate order. An empty incarnation
# matches whatever incarnation is stored (ANY_INCARNATION in redis_index.py).
#
# Incarnations: one MGET for every candidate. Then, for each candidate whose stored incarnation
# equals the given one, two boundaries along the chain, each found by a (K+1)-ary search:
#   confirmed = first block not in the confirmed SET,
#   matched   = first block neither confirmed nor speculative with a live expiry (ZMSCORE; only
#               when the replica has speculative entries, else matched = confirmed), searched
#               from the confirmed boundary on.
# A search keeps [lo, hi] holding the answer, every block before lo taken as held. One round
# reads lo, K blocks spread evenly inside, and hi-1 in one command; the first unheld probe
# narrows the window to the gap before it, all-held moves lo past the last probe. A window of at
# most K blocks is read whole, so the answer is exact inside it. K = 4 (measured: the cost is per
# block read, more than per command; K = 2..4 are fastest, 16 costs 1.4x, 64 2.6x): a
# 2,000-block chain takes at most six rounds of six blocks; a replica holding nothing, or all of
# it, one round. Walking the held run block by block instead cost 2.3 ms of Redis time on the
# benchmark's 16 replicas, the search 0.3 ms (bench/index_bench.py).
#
# The search assumes a replica's blocks along one chain form a prefix. vLLM keeps them so: it
# frees a request's blocks tail first, and a block is only cached behind its whole prefix (chained
# hashes), so no block is evicted before its descendants. When the index itself holds a gap (a
# lost removal event, one block trimmed by the cap), the answer is still a boundary: the block
# before it is held and the block at it is not, at or beyond the first gap.
LOOKUP = (
    _COMMON
    + r"""
local K = 4
local blob = ARGV[3]
local n = math.floor(#blob / 8)
local cands = {}
local from = 1
while true do
  local at = string.find(ARGV[4], '\0', from, true)
  if not at then
    cands[#cands + 1] = string.sub(ARGV[4], from)
    break
  end
  cands[#cands + 1] = string.sub(ARGV[4], from, at - 1)
  from = at + 1
end
local nc = math.floor(#cands / 2)
local hs = {}
local function member(i)
  local m = hs[i]
  if not m then
    m = string.sub(blob, 8 * i + 1, 8 * i + 8)
    hs[i] = m
  end
  return m
end
-- 1 where block pos[j] is held: confirmed (ck), or speculative with a live expiry (sk, if given)
local function held(ck, sk, pos)
  local ms = {}
  for j = 1, #pos do ms[j] = member(pos[j]) end
  local h = redis.call('SMISMEMBER', ck, unpack(ms))
  if sk then
    local s = redis.call('ZMSCORE', sk, unpack(ms))
    for j = 1, #pos do
      if h[j] == 0 and s[j] and tonumber(s[j]) > now then h[j] = 1 end
    end
  end
  return h
end
local function boundary(ck, sk, lo)
  local hi = n
  while lo < hi do
    local span = hi - lo
    local pos = {}
    if span <= K then
      for i = lo, hi - 1 do pos[#pos + 1] = i end
    else
      pos[1] = lo
      for j = 1, K do pos[#pos + 1] = lo + math.floor(j * span / (K + 1)) end
      pos[#pos + 1] = hi - 1
    end
    local h = held(ck, sk, pos)
    local cut = 0
    for j = 1, #pos do
      if h[j] == 0 then cut = j break end
    end
    -- a whole window is consecutive blocks: the update below then closes it at pos[cut]
    if cut == 0 then return hi end
    hi = pos[cut]
    if cut > 1 then lo = pos[cut - 1] + 1 end
  end
  return lo
end
local incs = {}
if nc > 0 then
  local keys = {}
  for c = 1, nc do keys[c] = P .. ':i:' .. cands[2 * c - 1] end
  incs = redis.call('MGET', unpack(keys))
end
local out = {}
for c = 1, nc do
  local rid = cands[2 * c - 1]
  local m, cf = 0, 0
  local want = cands[2 * c]
  local got = incs[c]
  if n > 0 and got and (want == '' or got == want) then
    local ck = P .. ':c:' .. rid
    local sk = P .. ':s:' .. rid
    cf = boundary(ck, nil, 0)
    m = cf
    if m < n and redis.call('EXISTS', sk) == 1 then
      m = boundary(ck, sk, cf)
    end
  end
  out[2 * c - 1] = m
  out[2 * c] = cf
end
return table.concat(out, ',')
"""
)

# ARGV: prefix, now, op, replica, incarnation (16 hex, ordered; '' = the stored one), chain,
# entry ttl ms, speculative ttl ms, per-replica cap, work budget (entries trimmed or evicted per
# call at most).
# op: 's' stored, 'r' removed, 'p' speculate, 'x' retract speculation (expire within the
# speculative ttl), 'c' clear (all incarnations).
# Returns {status, evicted}: status 1 applied, 0 older incarnation (ignored), 2 applied after
# dropping an older incarnation's entries; evicted = entries dropped by the per-replica cap.
WRITE = (
    _COMMON
    + r"""
local op, rid, inc, blob = ARGV[3], ARGV[4], ARGV[5], ARGV[6]
local ttl = tonumber(ARGV[7])
local sttl = tonumber(ARGV[8])
local cap = tonumber(ARGV[9])
local budget = tonumber(ARGV[10])
local IK = P .. ':i:' .. rid
local CK = P .. ':c:' .. rid
local TK = P .. ':t:' .. rid
local SK = P .. ':s:' .. rid

if op == 'c' then
  redis.call('UNLINK', CK, TK, SK)
  return {1, 0}
end

-- 16-hex-digit incarnations, compared as numbers (exactly: two 32-bit halves)
local function older(a, b)
  local a1, b1 = tonumber(string.sub(a, 1, 8), 16), tonumber(string.sub(b, 1, 8), 16)
  if a1 ~= b1 then return a1 < b1 end
  return tonumber(string.sub(a, 9, 16), 16) < tonumber(string.sub(b, 9, 16), 16)
end

local status = 1
local cur = redis.call('GET', IK)
if inc == '' then
  -- "whatever incarnation is current" (routers that do not follow the replica's events)
  inc = cur or '0000000000000000'
end
if cur ~= inc then
  if cur and not older(cur, inc) then
    return {0, 0}
  end
  -- a new incarnation (or none recorded): nothing of the old one may match
  redis.call('UNLINK', CK, TK, SK)
  if cur then status = 2 end
end
redis.call('SET', IK, inc, 'PX', 2 * ttl)

local n = math.floor(#blob / 8)
if n == 0 then
  return {status, 0}
end
local members = {}
for i = 1, n do
  members[i] = string.sub(blob, 8 * i - 7, 8 * i)
end
local evicted = 0

local function zadd(key, exp, xx)
  local za = {}
  for i = 1, n do
    za[2 * i - 1] = exp
    za[2 * i] = members[i]
  end
  if xx then
    redis.call('ZADD', key, 'XX', 'GT', unpack(za))
  else
    redis.call('ZADD', key, 'GT', unpack(za))
  end
end

if op == 's' then
  redis.call('SADD', CK, unpack(members))
  zadd(TK, now + ttl)
  -- expired entries first (lowest scores), then the soonest-expiring beyond the cap
  local dead = redis.call('ZRANGEBYSCORE', TK, '-inf', now, 'LIMIT', 0, budget)
  if #dead > 0 then
    redis.call('ZREM', TK, unpack(dead))
    redis.call('SREM', CK, unpack(dead))
  end
  local size = redis.call('ZCARD', TK)
  if size > cap then
    local popped = redis.call('ZPOPMIN', TK, math.min(size - cap, budget))
    local gone = {}
    for j = 1, #popped, 2 do
      gone[#gone + 1] = popped[j]
    end
    redis.call('SREM', CK, unpack(gone))
    evicted = #gone
  end
  redis.call('PEXPIRE', CK, ttl)
  redis.call('PEXPIRE', TK, ttl)
elseif op == 'p' then
  zadd(SK, now + sttl)
  -- a request routed here will hit the blocks the replica already holds: vLLM sends no event
  -- for a hit, so this is what keeps a hot prefix's confirmed entries from ageing out
  if redis.call('EXISTS', TK) == 1 then
    zadd(TK, now + ttl, true)
    redis.call('PEXPIRE', CK, ttl)
    redis.call('PEXPIRE', TK, ttl)
  end
  local dead = redis.call('ZCOUNT', SK, '-inf', now)
  if dead > 0 then
    redis.call('ZREMRANGEBYRANK', SK, 0, math.min(dead, budget) - 1)
  end
  local size = redis.call('ZCARD', SK)
  if size > cap then
    local k = math.min(size - cap, budget)
    redis.call('ZREMRANGEBYRANK', SK, 0, k - 1)
    evicted = k
  end
  if ARGV[2] ~= '' then
    redis.call('PEXPIRE', SK, ttl)  -- a fixed test clock: key TTLs cannot follow it
  elseif redis.call('PTTL', SK) < sttl then
    redis.call('PEXPIRE', SK, sttl)
  end
elseif op == 'r' then
  redis.call('SREM', CK, unpack(members))
  redis.call('ZREM', TK, unpack(members))
elseif op == 'x' then
  -- retract: the chain was computed (first token); its speculative entries end within the grace
  -- period (sttl), after which KV events alone speak for these blocks
  local za = {}
  for i = 1, n do
    za[2 * i - 1] = now + sttl
    za[2 * i] = members[i]
  end
  redis.call('ZADD', SK, 'XX', 'LT', unpack(za))
end
return {status, evicted}
"""
)
